import json
import os

import pytest
import yaml

from compress.run.config import load_config
from compress.training.checkpoint import read_weights
from conftest import ROOT, file_bytes, invoke, tree

EXPECTED_TREE = [
    "config.yaml",
    "distill/baseline.safetensors", "distill/baseline/last/checkpoint.safetensors", "distill/baseline/metrics.json",
    "distill/baseline/tensorboard/events", "distill/last/checkpoint.safetensors", "distill/metrics.json",
    "distill/model.safetensors", "distill/tensorboard/events",
    "export/export.json", "export/model.fp32.onnx", "export/model.int8.onnx", "export/model.ptq.onnx",
    "log.txt", "manifest.json",
    "qat/last/checkpoint.safetensors", "qat/metrics.json", "qat/qat.safetensors", "qat/tensorboard/events",
    "report.json", "report.md", "report.png",
    "teacher/last/checkpoint.safetensors", "teacher/metrics.json", "teacher/model.safetensors",
    "teacher/tensorboard/events",
]


def test_full_run_writes_exactly_the_documented_tree(finished_run, tiny_config):
    """(The tiny config has a hint loss, so the teacher runs on every batch: no teacher-output store. TensorBoard
    event files, named by time, host and process, are written when TensorBoard is installed.)"""
    import importlib.util

    found = sorted({os.path.dirname(p) + "/events" if "tfevents" in p else p for p in tree(finished_run)})
    expected = EXPECTED_TREE if importlib.util.find_spec("tensorboard") else [
        p for p in EXPECTED_TREE if not p.endswith("/events")]
    assert found == expected
    manifest = json.loads((finished_run / "manifest.json").read_text())
    assert [s["status"] for s in manifest["stages"].values()] == ["complete"] * 4
    assert load_config(str(finished_run / "config.yaml")) == load_config(tiny_config)
    assert (finished_run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_distilled_student_holds_the_student_alone(finished_run):
    tensors, meta = read_weights(finished_run / "distill" / "model.safetensors")
    assert meta["stage"] == "distill" and meta["model"] == "compact_cnn"
    assert not any(k.startswith(("regressor", "module.", "student.")) for k in tensors)
    assert "classifier.weight" in tensors


def test_metrics_hold_every_epoch_and_every_loss_term(finished_run):
    epochs = json.loads((finished_run / "distill" / "metrics.json").read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert {"train_ce", "train_kd", "train_hint", "val_acc", "images_per_s"} <= set(epochs[0])
    qat = json.loads((finished_run / "qat" / "metrics.json").read_text())["epochs"]
    assert all("int8_acc" in e and "val_acc" in e for e in qat)
    assert all({"train_ce", "train_kd"} <= set(e) for e in qat)  # labels + distillation from the float model


def test_rerun_skips_everything_and_changes_nothing(run_copy):
    before = file_bytes(run_copy)
    result = invoke("run", "--run-dir", run_copy)
    assert result.exit_code == 0, result.output
    assert result.stderr.count("up to date, skipped") == 4
    after = file_bytes(run_copy)
    assert {k: v for k, v in after.items() if not k.startswith("report")} == \
        {k: v for k, v in before.items() if not k.startswith("report")}


def test_force_redoes_a_stage_and_a_changed_value_reruns_it(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "export", "--force")
    assert result.exit_code == 0 and "export: running (--force)" in result.stderr
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.lr=0.0002")
    assert result.exit_code == 0, result.output
    assert "qat: running again: config changed (qat.lr)" in result.stderr


def test_upstream_change_invalidates_downstream(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "teacher", "--set", "teacher.epochs=1")
    assert result.exit_code == 0, result.output
    shown = invoke("show", run_copy).output
    assert "distill  invalidated (teacher/model.safetensors changed since this stage ran)" in shown
    result = invoke("run", "--run-dir", run_copy, "--stages", "distill")
    assert "distill: running again: its input teacher/model.safetensors changed" in result.stderr


def test_a_stage_needs_its_input(tmp_path, tiny_config):
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "empty", "--stages", "distill")
    assert result.exit_code == 2
    assert "run the teacher stage first: teacher/model.safetensors is not in" in result.stderr


@pytest.mark.parametrize("stages, missing", [
    ("teacher,export", "export: run the distill stage first: distill/model.safetensors"),
    ("teacher,distill,export", "export: run the qat stage first: qat/qat.safetensors"),
    ("teacher,qat", "qat: run the distill stage first: distill/model.safetensors"),
])
def test_a_stage_whose_input_no_earlier_stage_writes_stops_before_the_teacher_trains(tmp_path, tiny_config, stages,
                                                                                      missing):
    """Was: --dry-run said "export: run, after teacher", and the run trained the teacher, then stopped at export."""
    for launch in (["--dry-run"], [], ["--nproc-per-node", "2"]):  # the launcher refuses before torchrun starts
        result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "new", "--stages", stages, *launch)
        assert result.exit_code == 2, result.output
        assert missing in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "new").exists()


def test_show_reports_modified_files(run_copy):
    path = run_copy / "teacher" / "metrics.json"
    path.write_text(path.read_text() + " ")
    shown = invoke("show", run_copy).output
    assert "modified  teacher/metrics.json" in shown and "ok        teacher/model.safetensors" in shown


def test_resolved_config_is_written_and_reused(run_copy):
    cfg = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert cfg["data"]["name"] == "digits" and cfg["teacher"]["epochs"] == 2


def test_qat_accuracy_budget_fails_the_stage_and_keeps_its_outputs(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.optimizer=sgd",
                    "--set", "qat.lr=3", "--set", "qat.max_accuracy_drop=1")
    assert result.exit_code == 1, result.output
    assert "over the budget qat.max_accuracy_drop=1.0" in result.stderr and "Traceback" not in result.output
    assert (run_copy / "qat" / "qat.safetensors").is_file()
    assert json.loads((run_copy / "manifest.json").read_text())["stages"]["qat"]["status"] == "failed"
    shown = invoke("show", run_copy).output
    assert "qat      failed (qat: int8 accuracy" in shown


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


def test_every_training_stage_writes_its_epochs_for_tensorboard(finished_run):
    """Per-epoch scalars (loss terms, accuracy, learning rate, images/s) in <stage>[/<part>]/tensorboard/, read
    back with TensorBoard's own reader; skipped only when TensorBoard is not installed (an optional extra)."""
    import pytest

    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    expected = {"teacher": {"train_loss", "val_acc", "val_loss", "lr_end", "images_per_s"},
                "distill": {"train_loss", "train_ce", "train_kd", "train_hint", "val_acc", "lr_end", "images_per_s"},
                "distill/baseline": {"train_loss", "val_acc", "lr_end", "images_per_s"},
                "qat": {"train_loss", "val_acc", "int8_acc", "lr_end", "images_per_s"}}
    for folder, tags in expected.items():
        events = accumulator.EventAccumulator(str(finished_run / folder / "tensorboard"))
        events.Reload()
        assert tags <= set(events.Tags()["scalars"]), folder
        assert [e.step for e in events.Scalars("val_acc")] == [1, 2], folder
    metrics = json.loads((finished_run / "teacher" / "metrics.json").read_text())["epochs"]
    board = accumulator.EventAccumulator(str(finished_run / "teacher" / "tensorboard"))
    board.Reload()
    assert [e.value for e in board.Scalars("val_acc")] == pytest.approx([m["val_acc"] for m in metrics])
