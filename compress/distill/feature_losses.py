"""Losses on hidden representations: the cosine loss (CosineEmbeddingLoss with target 1) and the FitNets hint
(MSE after a trainable regressor). Each takes plain tensors; configuration stays in the stage.

`FEATURE_LOSSES` is the registry: name (also its config section, distill.<name>) -> FeatureLoss."""

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from compress.errors import InputError


def reduce_width(features, width):
    """Flatten to (N, D) and average-pool D down to `width` (1-D adaptive average pooling): how a wider
    teacher representation is compared with a narrower student's (2048 -> 1024 in the KD tutorial)."""
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
    s = student_features.flatten(1)
    return F.cosine_embedding_loss(s, teacher_reduced, torch.ones(len(s), device=s.device))


def hint_loss(regressed, teacher_features):
    """FitNets: MSE between the regressed student features and the teacher's hint features."""
    return F.mse_loss(regressed.flatten(1), teacher_features.flatten(1))


def make_regressor(kind, student_shape, teacher_shape):
    """The trainable map from the student's feature shape to the teacher's (shapes exclude the batch)."""
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


class FeatureLoss(NamedTuple):
    """One feature loss: `fn(student features, teacher features)`, how the log names it, and whether the teacher's
    side of it can be kept in the teacher-output store (a feature map per image is too large to)."""

    fn: Callable
    label: str
    stored: bool


FEATURE_LOSSES = {
    "cosine": FeatureLoss(cosine_loss, "cosine loss", stored=True),
    "hint": FeatureLoss(hint_loss, "FitNets hint", stored=False),
}
