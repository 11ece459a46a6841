"""The student trained alone - cross-entropy only, the same initialisation, schedule, seed and augmented views,
on the labelled images only - is what the report weighs distillation against. It does not depend on the teacher,
the distillation losses, the store or the unlabelled images, so a run that changes only those reuses the one an
earlier run trained: `made_with` records what it does depend on, and `finished` finds it again."""

import hashlib
import json
import logging

from compress.errors import CompressError
from compress.fileio import read_json
from compress.training.checkpoint import read_weights

log = logging.getLogger(__name__)

# What each part of `made_with` is, in the words the log uses when one of them changed
PARTS = {"config": "its config (distill settings other than the losses, data, model.student)",
         "weights": "model.student_weights, the labelled images' listing or model.student's code",
         "images": "the labelled images",
         "val": "the validation images", "precision": "the precision or memory layout",
         "world": "the number of processes", "device": "the device",
         "threads": "the thread count (CPU results are reproducible only at the same one)",
         "clip_grad_norm": "train.clip_grad_norm"}


def key_of(made_with):
    """{part: value} of PARTS -> the 16-hex-digit key of the student alone it describes."""
    return hashlib.sha256(json.dumps(made_with, sort_keys=True).encode()).hexdigest()[:16]


def why_again(saved, made_with):
    """Why an earlier run's student alone cannot be reused, in words ('' when nothing says)."""
    before = saved.get("made_with") if isinstance(saved, dict) else None
    if not isinstance(before, dict):
        return ""
    changed = [PARTS[k] for k in PARTS if before.get(k) != made_with.get(k)]
    return f"{', '.join(changed)} changed since" if changed else ""


def finished(metrics_path, weights_path, made_with, epochs):
    """The per-epoch history of a student alone an earlier run trained from the same `made_with`, or None - only
    when its weights file is the one that run wrote (checked by sha256) and it ran `epochs` epochs. Says why an
    earlier one there is not reused."""
    key = key_of(made_with)
    try:
        saved = read_json(metrics_path, "the student alone's metrics")
        why = why_again(saved, made_with) if isinstance(saved, dict) and saved.get("baseline_key") != key else ""
        if why:
            log.info("distill: training the student alone again: %s", why)
        if not isinstance(saved, dict) or saved.get("baseline_key") != key or not isinstance(saved.get("sha256"), str):
            return None
        _, meta = read_weights(weights_path, expect_sha256=saved["sha256"])
    except CompressError:
        return None
    history = saved.get("epochs")
    if meta.get("baseline_key") != key or not isinstance(history, list) or len(history) != epochs \
            or not all(isinstance(h, dict) and isinstance(h.get("epoch"), int) and
                       isinstance(h.get("val_acc"), (int, float)) for h in history):
        return None
    return history
