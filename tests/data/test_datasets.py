"""Loading a dataset (compress.data.datasets): the split and the normalisation, and the data summary a run
prints before its first stage."""

import pytest
import torch

from compress.data.datasets import load_data
from conftest import data_cfg, image_tree, invoke


def test_split_is_deterministic_from_the_split_seed_only():
    a = load_data(data_cfg("data.name=digits"), seed=0)
    b = load_data(data_cfg("data.name=digits"), seed=1)  # another training seed: the same validation images
    c = load_data(data_cfg("data.name=digits", "data.split_seed=1"), seed=0)
    assert torch.equal(a.val.labels, b.val.labels) and torch.equal(a.val.images, b.val.images)
    assert not torch.equal(a.val.images, c.val.images)
    assert len(a.train) + len(a.val) == 1797 and len(a.val) == 180


def test_normalisation_is_computed_on_the_train_split():
    data = load_data(data_cfg("data.name=digits"), seed=0)
    x = data.train.batch(range(len(data.train))).x
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1.0) < 1e-2
    given = load_data(data_cfg("data.name=digits", "data.mean=[0.5]", "data.std=[0.5]"), seed=0)
    assert given.mean == (0.5,) and given.std == (0.5,)


@pytest.mark.e2e
def test_the_data_summary_comes_before_the_first_stage(tmp_path):
    image_tree(tmp_path / "img")
    result = invoke("run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.name=imagefolder",
                    "--set", f"data.root={tmp_path / 'img'}", "--set", "data.image_size=8", "--set", "teacher.epochs=1",
                    "--set", "model.teacher=compact_cnn")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    summary = next(i for i, line in enumerate(lines) if "data: imagefolder" in line)
    assert summary < next(i for i, line in enumerate(lines) if "teacher: running" in line)
    assert "train/ and val/ folders, used as given" in lines[summary]
    assert "2 classes (cat, dog); 8 training / 8 validation images" in lines[summary + 1]
    assert "images 3x8x8" in lines[summary + 2]
