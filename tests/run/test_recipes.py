"""The shipped recipes (compress.run.recipes): by name or by path from any folder, and the KD tutorial's
models and layers run."""

import json
import os

import pytest

from compress.run import recipes
from compress.training.checkpoint import read_weights
from conftest import ROOT, compress_subprocess, invoke


def test_a_folder_named_like_a_recipe_does_not_hide_the_recipe(tmp_path, monkeypatch):
    """`compress run -c photos` from a home folder that holds `photos/` (the user's images) is the recipe."""
    (tmp_path / "photos").mkdir()
    (tmp_path / "mine.yaml").write_text("seed: 1\n")
    monkeypatch.chdir(tmp_path)
    path, note = recipes.resolve("photos")
    assert path == recipes.path_of("photos") and "also a folder here" in note
    assert recipes.resolve("mine.yaml") == ("mine.yaml", "")  # a file of the user's is theirs
    (tmp_path / "other").mkdir()
    assert recipes.resolve("other") == ("other", "")  # a folder naming no recipe: refused when read


@pytest.mark.e2e
def test_recipes_work_by_name_and_by_their_repository_path_from_any_folder(tmp_path):
    """Recipes work by name and by their repository path from any folder, not only inside a clone."""
    by_name = compress_subprocess("config", "-c", "digits-quick", cwd=tmp_path)
    by_path = compress_subprocess("config", "-c", "configs/digits-quick.yaml", cwd=tmp_path)
    assert by_name.returncode == 0 and by_path.returncode == 0, by_name.stderr + by_path.stderr
    assert "name: digits" in by_name.stdout and by_name.stdout == by_path.stdout
    listing = compress_subprocess("config", "--list", cwd=tmp_path).stdout
    assert {"cifar10", "default", "digits-quick", "cifar10-tutorial", "photos"} <= {
        line.split()[0] for line in listing.splitlines()}
    for line in listing.splitlines():  # each description is a whole sentence, or says it goes on
        assert line.rstrip().endswith((".", " ...")), line
    missing = compress_subprocess("run", "-c", "cifar11", cwd=tmp_path)
    assert missing.returncode == 2 and "not found, and it names no shipped recipe; did you mean 'cifar10'?" in \
        missing.stderr
    assert "cifar10, cifar10-tutorial, default" in missing.stderr and not list(tmp_path.iterdir())


@pytest.mark.e2e
def test_the_kd_tutorial_config_runs_its_models_and_layers(tmp_path):
    """configs/cifar10-tutorial.yaml with 3x32x32 images from an imagefolder tree standing in for CIFAR-10:
    the tutorial's teacher/student, cosine on flattened features (2048 -> 1024) and the 16 -> 32 channel hint."""
    import numpy as np
    from PIL import Image

    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    for cls in ("plane", "car"):
        (root / cls).mkdir(parents=True)
        for i in range(24):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    config = os.path.join(ROOT, "configs", "cifar10-tutorial.yaml")
    result = invoke("run", "-c", config, "--run-dir", tmp_path / "run", "--stages", "teacher,distill",
                    "--set", "data.name=imagefolder", "--set", f"data.root={root}", "--set", "data.image_size=32",
                    "--set", "teacher.epochs=1", "--set", "distill.epochs=1", "--set", "teacher.batch_size=16",
                    "--set", "distill.batch_size=16", "--set", "distill.cosine.weight=0.25",
                    "--set", "distill.hint.weight=0.25", "--set", "train.progress=false")
    assert result.exit_code == 0, result.output
    epochs = json.loads((tmp_path / "run" / "distill" / "metrics.json").read_text())["epochs"]
    assert {"train_ce", "train_kd", "train_cosine", "train_hint"} <= set(epochs[0])
    _, meta = read_weights(tmp_path / "run" / "teacher" / "model.safetensors")
    assert meta["model"] == "deep_cnn" and meta["input_shape"] == [3, 32, 32]
