"""What a stage's context gives it (compress.run.context): per-epoch scalars for TensorBoard."""

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
