"""Real DDP: 2 gloo processes on the CPU, launched by `compress run --nproc-per-node 2` and by torchrun."""

import json
import os
import subprocess
import sys

from compress.checkpoint import read_weights
from conftest import compress_subprocess


def test_two_processes_run_the_pipeline_with_identical_replicas(finished_run, tiny_config, tmp_path):
    run = tmp_path / "ddp"
    proc = compress_subprocess("run", "-c", tiny_config, "--run-dir", run, "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
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
    assert proc.stderr.count("teacher: epoch 1/2") == 1
    assert len(json.loads((run / "teacher" / "metrics.json").read_text())["epochs"]) == 2
    # same global batch as the 1-process run: comparable accuracy
    single = json.loads((finished_run / "manifest.json").read_text())["stages"]
    for stage, key in (("teacher", "val_acc"), ("distill", "val_acc"), ("qat", "int8_acc")):
        assert abs(manifest[stage]["metrics"][key] - single[stage]["metrics"][key]) < 6.0, stage


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
