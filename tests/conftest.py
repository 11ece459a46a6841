"""Shared fixtures: a tiny config on scikit-learn's 8x8 digits, the CLI in-process and as a subprocess, one
completed pipeline run that read-only tests share (tests that change files work on a copy), and the image folders
and files that tests of several packages build."""

import os
import random
import shutil
import subprocess
import sys

# One torch thread per process, in this process and every `compress` it starts (which honours OMP_NUM_THREADS):
# the suite's tiny models gain nothing from a second thread (measured: 192 s with one, 188 s with two), and the
# README runs it in two pytest-xdist workers on 2 cores, where two-thread processes beside each other would
# wait on one another's cores (see compress/cpus.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from compress.cli import cli
from compress.data.datasets import load_data
from compress.run.config import load_config

TINY_CONFIG = """\
seed: 0
data: {name: digits, augment: pad_crop, crop_padding: 1}
model: {teacher: resnet14, student: compact_cnn}
train: {eval_batch_size: 256, progress: false}
teacher: {epochs: 2, batch_size: 32}
distill:
  epochs: 2
  batch_size: 32
  views: 3
  hint: {weight: 0.25, teacher_layer: layers, student_layer: block1}
qat: {epochs: 2, batch_size: 32, max_accuracy_drop: 100.0, float_layers: []}
export: {latency_batch_sizes: [1, 8], latency_repeats: 2, latency_warmup: 0, min_int8_speedup: 0.0}
"""


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(TINY_CONFIG)
    return str(path)


def invoke(*args):
    """The real CLI, in-process (click's CliRunner); stderr kept apart from stdout."""
    runner = CliRunner()
    return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)


def compress_subprocess(*args, env=None, timeout=600, cwd=None):
    """The installed console script, as a user runs it (from `cwd` when given)."""
    exe = shutil.which("compress") or os.path.join(os.path.dirname(sys.executable), "compress")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([exe, *[str(a) for a in args]], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=cwd)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
FAULTS = os.path.join(ROOT, "tests", "faults.py")


def fault_subprocess(*args, fault, env=None, timeout=600):
    """`compress` run through tests/faults.py with COMPRESS_FAULT=`fault` (see that file)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "COMPRESS_FAULT": fault, **(env or {})}
    return subprocess.run([sys.executable, FAULTS, *[str(a) for a in args]], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def random_seed(name, default):
    """The seed of a randomised test: `default`, so that every run of the suite (CI's too) draws the same; else
    COMPRESS_TEST_SEED=<seed> (another seed, or a failure's, replayed) or COMPRESS_TEST_SEED=random (a fresh one).
    Printed, so that any run can be replayed."""
    chosen = os.environ.get("COMPRESS_TEST_SEED") or str(default)
    seed = random.SystemRandom().randrange(2**32) if chosen == "random" else int(chosen)
    print(f"{name}: COMPRESS_TEST_SEED={seed}")
    return seed


# Fixtures that do a run: a test that uses one (directly or through another fixture) is end-to-end, marked `e2e`
# here so that none lands in the fast tier (`pytest -m "not e2e"`) unmarked. Tests that run the pipeline or the
# CLI's `run` themselves, or take more than ~2 s, carry the mark in their file.
E2E_FIXTURES = {"finished_run", "run_copy", "ddp_run", "teacher_run"}


def pytest_collection_modifyitems(items):
    for item in items:
        if E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, tiny_config):
    """All four stages on the tiny config, once per session. Treat as read-only."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    result = invoke("run", "-c", tiny_config, "--run-dir", run_dir)
    assert result.exit_code == 0, result.output
    return run_dir


@pytest.fixture
def short_tmpdir():
    """A temporary folder for a subprocess's TMPDIR, short enough for the sockets DataLoader workers use (a path
    under pytest's tmp_path can pass the 75 characters they allow), removed afterwards."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="compress-", dir="/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def run_copy(finished_run, tmp_path):
    """A private copy of the finished run, free to modify."""
    target = tmp_path / "run"
    shutil.copytree(finished_run, target)
    return target


def forge_metadata(run, rel, key, value):
    """Rewrite weights file `rel` of `run` with metadata `key` set to `value` (text) and its sha256 updated in
    manifest.json, so that it reads as its stage's own output; the file's path."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from compress.fileio import sha256_file

    path = run / rel
    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata())
    save_file(load_file(str(path)), str(path), metadata={**metadata, key: value})
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"][rel.split("/")[0]]["outputs"][rel] = sha256_file(path)
    (run / "manifest.json").write_text(json.dumps(manifest))
    return path


def tree(root):
    """Every file under root as a sorted list of relative paths."""
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


def file_bytes(root):
    """Every file's bytes (a link as its target, a pipe as a marker: reading one would block)."""
    out = {}
    for rel in tree(root):
        path = os.path.join(root, rel)
        if os.path.islink(path):
            out[rel] = f"link -> {os.readlink(path)}"
        elif not os.path.isfile(path):
            out[rel] = "not a regular file"
        else:
            with open(path, "rb") as f:
                out[rel] = f.read()
    return out


HANG = 180  # seconds: far beyond what each command needs, far below the hours a hang would take


def data_cfg(*overrides):
    return load_config(None, list(overrides)).data


def image_tree(root, splits=("train", "val"), classes=("cat", "dog"), count=4, seed=0):
    rng = np.random.default_rng(seed)
    for split in splits:
        for cls in classes:
            folder = root / split / cls if split else root / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def sized_image_tree(root, splits, classes=("cat", "dog"), count=6, size=(20, 24)):
    for split in splits:
        rng = np.random.default_rng([0, *split.encode()])  # each split its own images, whichever call makes it
        for cls in classes:
            folder = root / split / cls if split else root / cls
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def images(folder, n, shade=0, size=12):
    """`n` real PNG files, each different (its pixels encode its index and `shade`)."""
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (size, size), ((37 * i) % 256, (11 * i + shade) % 256, shade % 256)).save(
            os.path.join(folder, f"{i:03d}.png"))


@pytest.fixture
def photos(tmp_path):
    """An image folder with train/ and val/ splits of two classes, and a folder of other, unlabelled images."""
    root = tmp_path / "photos"
    for split, n in (("train", 12), ("val", 4)):
        for c, name in enumerate(("cat", "dog")):
            images(root / split / name, n, shade=100 * c + (50 if split == "val" else 0))
    unlabeled = tmp_path / "unlabeled"
    images(unlabeled, 5, shade=200)
    return root, unlabeled


def write_val_pngs(tmp_path, count=6):
    data = load_data(load_config(None, ["data.name=digits"]).data, seed=0)
    images, labels = data.val.raw(list(range(count)))
    paths = []
    for i, img in enumerate(images):
        path = tmp_path / f"val{i}.png"
        Image.fromarray(img[0].numpy()).save(path)
        paths.append(str(path))
    x = data.val.batch(range(count)).x
    return paths, x
