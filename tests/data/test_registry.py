"""The dataset registry (compress.data.registry): each entry's channels and size are what its loader loads, so the
checks that run before any image is read (the preflight, the dry run) see the shapes the run will."""

import pytest

from compress.data.datasets import load_data
from compress.data.registry import DATASETS, input_shape_of
from conftest import data_cfg


@pytest.mark.parametrize("name", [n for n, d in DATASETS.items() if not d.reads_root])  # the ones that bring their own
def test_a_datasets_registered_shape_is_the_shape_it_loads(name):                       # images: every one added too
    cfg = data_cfg(f"data.name={name}")
    assert load_data(cfg, seed=0).input_shape == input_shape_of(cfg) == (DATASETS[name].channels,
                                                                          DATASETS[name].size, DATASETS[name].size)


def test_a_dataset_added_to_the_registry_is_described_in_its_own_words(monkeypatch):
    """The log's data lines for a dataset the registry gained: its description and shape, its flip default, its
    images counted when a stage loads them - not another dataset's words."""
    from compress.data.datasets import describe

    monkeypatch.setitem(DATASETS, "digits16", DATASETS["digits"]._replace(description="my 16x16 digits", size=16))
    cfg = data_cfg("data.name=digits")
    object.__setattr__(cfg, "name", "digits16")  # the config's name check was made at import, before the entry
    lines = describe(cfg)["lines"]
    assert lines[0] == "data: digits16, my 16x16 digits"
    assert "counted when a stage loads them" in lines[1] and "images 1x16x16" in lines[2]
    assert "horizontal flip" not in lines[2]
