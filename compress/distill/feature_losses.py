"""Losses on hidden representations: the cosine loss (CosineEmbeddingLoss with target 1) and the FitNets hint
(MSE after a trainable regressor). Each takes plain tensors; configuration stays in the stage. torch is imported
inside the functions, so the config reads this registry without loading it.

`FEATURE_LOSSES` is the registry: name (also its config section, distill.<name>) -> FeatureLoss. The frozen
teacher, the student's wrapper, the loss, the preflight and the baseline's key all loop over it."""

from typing import Callable, NamedTuple

from compress.errors import InputError


def reduce_width(features, width):
    """Flatten to (N, D) and average-pool D down to `width` (1-D adaptive average pooling): how a wider
    teacher representation is compared with a narrower student's (2048 -> 1024 in the KD tutorial)."""
    import torch.nn.functional as F

    flat = features.flatten(1)
    if flat.shape[1] == width:
        return flat
    if flat.shape[1] < width:
        raise InputError(f"cannot reduce a teacher representation of width {flat.shape[1]} to the student's wider "
                         f"{width}; pick a wider teacher layer or a narrower student layer")
    return F.adaptive_avg_pool1d(flat.unsqueeze(1), width).squeeze(1)


def cosine_loss(student_features, teacher_reduced):
    """CosineEmbeddingLoss with target 1 between the student's flattened features and the teacher's
    (already reduced to the student's width): mean of 1 - cos(s, t)."""
    import torch
    import torch.nn.functional as F

    s = student_features.flatten(1)
    return F.cosine_embedding_loss(s, teacher_reduced, torch.ones(len(s), device=s.device))


def hint_loss(regressed, teacher_features):
    """FitNets: MSE between the regressed student features and the teacher's hint features."""
    import torch.nn.functional as F

    return F.mse_loss(regressed.flatten(1), teacher_features.flatten(1))


def make_regressor(kind, student_shape, teacher_shape):
    """The trainable map from the student's feature shape to the teacher's (shapes exclude the batch)."""
    import torch

    if kind == "linear":
        return torch.nn.Linear(_numel(student_shape), _numel(teacher_shape))
    if len(student_shape) != 3 or len(teacher_shape) != 3:
        raise InputError(f"distill.hint.regressor={kind} needs 4-D feature maps but got student {tuple(student_shape)}"
                         f" and teacher {tuple(teacher_shape)}; use distill.hint.regressor=linear")
    if student_shape[1:] != teacher_shape[1:]:
        raise InputError(f"distill.hint: student features {tuple(student_shape)} and teacher features "
                         f"{tuple(teacher_shape)} differ in spatial size, which a {kind} regressor keeps; pick layers "
                         "of equal resolution or use distill.hint.regressor=linear")
    k = 3 if kind == "conv3x3" else 1
    return torch.nn.Conv2d(student_shape[0], teacher_shape[0], kernel_size=k, padding=k // 2)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _as_is(teacher_features, student_shape):
    return teacher_features


def _reduced(teacher_features, student_shape):
    return reduce_width(teacher_features, _numel(student_shape))


def _no_adapter(section, student_shape, teacher_shape):
    return None


def _regressor(section, student_shape, teacher_shape):
    return make_regressor(section.regressor, student_shape, teacher_shape)


class FeatureLoss(NamedTuple):
    """One feature loss, whose config section is distill.<name> (`weight`, `teacher_layer`, `student_layer`, and
    any settings of its own). The teacher layer's output goes through `teacher_side(features, student shape)` in
    the frozen teacher; the student layer's through the trainable module `adapter(section, student shape, teacher
    shape)` builds (None: as it is), trained with the student and dropped after distillation; `fn(student side,
    teacher side)` is the loss between them. Both sides' shapes are probed, and must fit, before any training.

    `stored`: the teacher side is kept in the teacher-output store. The store holds one feature vector per image and
    view, the cosine loss's (in its chunks' "cosine" tensor), so that stays the only stored loss; with any other
    feature loss on, the teacher runs on every batch. `adapter_name`: the adapter's module name in the resume
    checkpoint (the loss's name when empty)."""

    fn: Callable
    label: str
    stored: bool = False
    teacher_side: Callable = _as_is
    adapter: Callable = _no_adapter
    adapter_name: str = ""


FEATURE_LOSSES = {
    "cosine": FeatureLoss(cosine_loss, "cosine loss", stored=True, teacher_side=_reduced),
    "hint": FeatureLoss(hint_loss, "FitNets hint", adapter=_regressor, adapter_name="regressor"),
}
STORED_FEATURE = "cosine"  # the one feature loss whose teacher side the store keeps
