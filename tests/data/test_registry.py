"""The dataset registry (compress.data.registry): each entry's channels and size are what its loader loads, so the
checks that run before any image is read (the preflight, the dry run) see the shapes the run will."""

import pytest

from compress.data.datasets import load_data
from compress.data.registry import DATASETS, input_shape_of
from conftest import data_cfg


@pytest.mark.parametrize("name", ["mnist5k", "digits"])  # the offline ones; cifar10 and imagefolder read your files
def test_a_datasets_registered_shape_is_the_shape_it_loads(name):
    cfg = data_cfg(f"data.name={name}")
    assert load_data(cfg, seed=0).input_shape == input_shape_of(cfg) == (DATASETS[name].channels,
                                                                          DATASETS[name].size, DATASETS[name].size)
