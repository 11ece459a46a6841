"""Pretrained starts by name: `model.teacher_weights=torchvision:IMAGENET1K_V1` (or `pretrained`) is found in
torch's cache ($TORCH_HOME/hub/checkpoints/, the file torchvision itself would download) and loaded offline; a
name whose file is not there is one sentence naming the file to place and where. The tests write the weights
file themselves: nothing here touches the network (COMPRESS_OFFLINE is set)."""

import os

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from compress.errors import InputError
from compress.models.registry import build_model
from compress.models.weights import load_pretrained, weights_file
from conftest import invoke

FILE = "mobilenet_v3_small-047dcff4.pth"  # the basename of MobileNet_V3_Small_Weights.IMAGENET1K_V1.url


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setenv("COMPRESS_OFFLINE", "1")
    return home


def place_imagenet_weights(home):
    torch.manual_seed(7)
    state = torchvision.models.mobilenet_v3_small(num_classes=1000).state_dict()
    path = home / "hub" / "checkpoints" / FILE
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return path, state


def test_a_torchvision_weights_name_is_the_file_in_torchs_cache_and_loads(torch_home):
    path, state = place_imagenet_weights(torch_home)
    for name in ("torchvision:IMAGENET1K_V1", "pretrained", "torchvision:DEFAULT",
                 "torchvision:MobileNet_V3_Small_Weights.IMAGENET1K_V1"):
        assert weights_file(name, "torchvision:mobilenet_v3_small", "model.teacher_weights", download=True) == \
            str(path)
    model = build_model("torchvision:mobilenet_v3_small", (3, 32, 32), 10)
    note = load_pretrained(model, str(path), "model.teacher_weights")
    assert "replaced by a new one of shape (10, 1024)" in note  # ImageNet's 1000-class head -> the data's 10
    loaded = model.state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in state.items() if not k.startswith("classifier.3"))


def test_a_weights_name_that_is_not_there_or_not_the_models_is_one_sentence(torch_home):
    with pytest.raises(InputError) as e:
        weights_file("pretrained", "torchvision:mobilenet_v3_small", "model.teacher_weights", download=True)
    assert str(e.value) == (
        "model.teacher_weights: torchvision's MobileNet_V3_Small_Weights.IMAGENET1K_V1 is not in torch's cache and "
        "COMPRESS_OFFLINE is set; download https://download.pytorch.org/models/mobilenet_v3_small-047dcff4.pth and "
        f"place it at {torch_home / 'hub' / 'checkpoints' / FILE} (or set TORCH_HOME to the folder whose "
        "hub/checkpoints/ holds it)")
    with pytest.raises(InputError, match=r"has no weights 'IMAGENET1K_V9'; choose one of torchvision:IMAGENET1K_V1, "
                                         r"torchvision:DEFAULT \(or pretrained\)"):
        weights_file("torchvision:IMAGENET1K_V9", "torchvision:mobilenet_v3_small", "model.teacher_weights")
    with pytest.raises(InputError, match=r"model.student is 'compact_cnn', not a torchvision model"):
        weights_file("pretrained", "compact_cnn", "model.student_weights")


def photo_folder(root):
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("val", 4)):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")


def test_a_run_starts_the_teacher_from_the_cached_weights_offline_or_says_what_to_place(torch_home, tmp_path):
    photo_folder(tmp_path / "photos")
    args = ["run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.name=imagefolder",
            "--set", f"data.root={tmp_path / 'photos'}", "--set", "data.image_size=32", "--set", "teacher.epochs=1",
            "--set", "teacher.batch_size=8", "--set", "model.teacher=torchvision:mobilenet_v3_small",
            "--set", "model.teacher_weights=torchvision:IMAGENET1K_V1", "--set", "train.progress=false"]
    missing = invoke(*args)
    assert missing.exit_code == 2 and "Traceback" not in missing.output
    assert f"download https://download.pytorch.org/models/{FILE} and place it at" in missing.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
    place_imagenet_weights(torch_home)
    ran = invoke(*args)
    assert ran.exit_code == 0, ran.output
    assert f"teacher: model.teacher_weights: loaded {FILE}" in ran.stderr
    assert "up to date, skipped" in invoke(*args).stderr  # the cached file's sha256 is the stage's input
    os.utime(torch_home / "hub" / "checkpoints" / FILE)  # touched, same bytes: still up to date
    assert "up to date, skipped" in invoke(*args).stderr
