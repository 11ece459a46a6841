"""Real DDP: 2 gloo processes on the CPU, launched by `compress run --nproc-per-node 2` and by torchrun."""

import json
import os
import subprocess
import sys

import pytest
import torch

from compress.checkpoint import read_weights
from conftest import FAULTS, compress_subprocess


@pytest.fixture(scope="module")
def ddp_run(tiny_config, tmp_path_factory):
    run = tmp_path_factory.mktemp("ddp") / "run"
    proc = compress_subprocess("run", "-c", tiny_config, "--run-dir", run, "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stderr


def test_two_processes_run_the_pipeline_with_identical_replicas(finished_run, ddp_run):
    run, stderr = ddp_run
    manifest = json.loads((run / "manifest.json").read_text())["stages"]
    assert all(manifest[s]["world_size"] == 2 for s in ("teacher", "distill", "qat", "export"))
    # every parameter identical across ranks after training; after the freeze epochs, every observer,
    # fake-quant and BN buffer too (checked by the stages themselves, against rank 0's copy)
    assert manifest["teacher"]["metrics"]["replicas_identical"] is True
    assert manifest["distill"]["metrics"]["replicas_identical"] is True  # hint regressor included
    assert manifest["qat"]["metrics"]["buffers_identical"] is True
    for rel in ("teacher/model.safetensors", "distill/model.safetensors", "qat/qat.safetensors"):
        tensors, _ = read_weights(run / rel)
        assert not any(k.startswith("module.") for k in tensors), rel
    # rank 0 alone logs and writes
    assert stderr.count("teacher: epoch 1/2") == 1
    assert len(json.loads((run / "teacher" / "metrics.json").read_text())["epochs"]) == 2
    # same global batch as the 1-process run: comparable accuracy
    single = json.loads((finished_run / "manifest.json").read_text())["stages"]
    for stage, key in (("teacher", "val_acc"), ("distill", "val_acc"), ("qat", "int8_acc")):
        assert abs(manifest[stage]["metrics"][key] - single[stage]["metrics"][key]) < 6.0, stage


def test_a_lost_worker_restarts_the_group_which_resumes_identically(ddp_run, tiny_config, tmp_path):
    """kill -9 of rank 1 mid-epoch; --max-restarts 1 restarts both workers, which resume from the last
    checkpoint and end with the weights of the uninterrupted 2-process run."""
    reference, _ = ddp_run
    run = tmp_path / "lost"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
         "1", FAULTS, "run", "-c", tiny_config, "--run-dir", str(run), "--stages", "teacher"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COMPRESS_FAULT": "teacher:1:6:kill:1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lost contact with another worker" in proc.stderr and "resuming" in proc.stderr
    a, _ = read_weights(reference / "teacher" / "model.safetensors")
    b, _ = read_weights(run / "teacher" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_torchrun_launch_trains_the_teacher(tiny_config, tmp_path):
    run = tmp_path / "torchrun"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "compress", "run", "-c", tiny_config, "--run-dir", str(run), "--stages", "teacher",
         "--set", "teacher.epochs=1"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())["stages"]["teacher"]
    assert manifest["status"] == "complete" and manifest["world_size"] == 2
    assert manifest["metrics"]["val_acc"] > 50.0
