"""What a stage's context gives it (compress.run.context): per-epoch scalars for TensorBoard, and upstream weights it
refuses in one sentence."""

import json

import pytest

pytestmark = pytest.mark.e2e


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


def test_a_tensorboard_folder_removed_under_a_run_stops_the_scalars_not_the_training(tmp_path, caplog):
    """TensorBoard is a view of the run: its folder deleted between epochs is one warning, and the training goes
    on (its writer thread used to fail the stage with a traceback)."""
    import importlib.util
    import shutil

    from compress.run.context import _Board

    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed (an optional extra)")
    board = _Board(str(tmp_path / "tensorboard"), epochs=3)
    board.write({"epoch": 1, "train_loss": 1.0})
    shutil.rmtree(tmp_path / "tensorboard")
    board.write({"epoch": 2, "train_loss": 0.5})
    board.write({"epoch": 3, "train_loss": 0.2})
    assert not board.enabled and "TensorBoard scalars stop here" in caplog.text
    assert not (tmp_path / "tensorboard").exists()


def test_a_weights_file_whose_class_names_are_not_names_is_refused_in_one_sentence(run_copy):
    """distill/model.safetensors rewritten with class_names [1, 2] and its sha256 updated in manifest.json: the
    stage that loads it refuses it in one sentence naming the file (it was an unexpected TypeError)."""
    from conftest import forge_metadata, invoke

    path = forge_metadata(run_copy, "distill/model.safetensors", "class_names", "[1, 2]")
    result = invoke("run", "--run-dir", run_copy, "--stages", "export")
    assert result.exit_code == 2, result.output
    assert f"error: '{path}' was trained on 2 classes (1, 2), but the data now has 10 classes (" in result.stderr
    assert "unexpected" not in result.stderr
