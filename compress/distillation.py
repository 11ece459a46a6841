"""The pieces of distillation that hold state: the student with its training-only regressor, the frozen
teacher's outputs, and the teacher-output cache.

The teacher is frozen and in eval mode, so its outputs for a given image never change. Without augmentation
`build_cache` computes them once per training image; with augmentation and `distill.views: K`, once per each
image's K fixed augmented views (the FKD idea, Shen & Xing, ECCV 2022: soft labels of reproducible crops,
stored once and reused), and each epoch shows every image one of its views. Either way the student and the
teacher see the same pixels (consistent teaching), and every epoch looks the teacher's answer up instead of
running the teacher. With augmentation and no views, the teacher runs on every batch.
"""

import logging

import torch
from torch import nn

from compress.features import FeatureTap
from compress.losses import reduce_width

log = logging.getLogger(__name__)


class StudentWithRegressor(nn.Module):
    """The student plus its training-only hint regressor, trained as one module inside one DDP wrapper (so
    the regressor's gradients are synchronised too). Returns logits and the features the losses need."""

    def __init__(self, student, cosine_layer=None, hint_layer=None):
        super().__init__()
        self.student = student
        self.regressor = None
        self.cosine_layer, self.hint_layer = cosine_layer, hint_layer
        self.tap = FeatureTap(student, [n for n in (cosine_layer, hint_layer) if n], role="student")

    def add_regressor(self, regressor):
        self.regressor = regressor

    def forward(self, x):
        logits = self.student(x)
        cosine = self.tap.outputs.get(self.cosine_layer) if self.cosine_layer else None
        hint = None
        if self.hint_layer and self.regressor is not None:
            features = self.tap.outputs[self.hint_layer]
            hint = self.regressor(features.flatten(1) if isinstance(self.regressor, nn.Linear) else features)
        return logits, cosine, hint


class FrozenTeacher:
    """The teacher in eval mode, without gradients, never wrapped in DDP. Call it for a dict of outputs."""

    def __init__(self, teacher, cosine_layer=None, hint_layer=None, cosine_width=None):
        self.model = teacher.eval().requires_grad_(False)
        self.cosine_layer, self.hint_layer, self.cosine_width = cosine_layer, hint_layer, cosine_width
        self.tap = FeatureTap(teacher, [n for n in (cosine_layer, hint_layer) if n], role="teacher")

    @torch.no_grad()
    def __call__(self, x):
        out = {"logits": self.model(x)}
        if self.cosine_layer and self.cosine_width:
            out["cosine"] = reduce_width(self.tap.outputs[self.cosine_layer], self.cosine_width)
        if self.hint_layer:
            out["hint"] = self.tap.outputs[self.hint_layer]
        return out


class TeacherCache:
    """Teacher outputs for every training sample - or for each of its `views` fixed augmented views - kept on
    the CPU and looked up by (sample index, view)."""

    def __init__(self, tensors, size, views=0):
        self.tensors, self.size, self.views = tensors, size, views

    def lookup(self, indices, views, device):
        rows = indices if not self.views else views * self.size + indices
        return {k: v[rows].to(device, non_blocking=True) for k, v in self.tensors.items()}

    def nbytes(self):
        return sum(v.numel() * v.element_size() for v in self.tensors.values())


def cache_bytes(teacher, dataset, views):
    """What the cache of this teacher's outputs would take, from one sample's outputs."""
    one = teacher(dataset.batch([0]).x)
    return sum(v[0].numel() * v.element_size() for v in one.values()) * len(dataset) * max(views, 1)


@torch.no_grad()
def build_cache(teacher, dataset, env, batch_size, views=0, inputs=None):
    """Run the teacher once over every training sample (views=0: the un-augmented images; views=K: each image's
    K fixed augmented views, exactly as the student will see them), each rank a strided share of the
    (view, sample) pairs in fixed chunks, then all-gathered. Deterministic: a resumed run rebuilds the same.
    `inputs` places a batch on the device in the training's memory format (default: `.to(env.device)`)."""
    inputs = inputs or (lambda x: x.to(env.device))
    n = len(dataset)
    pairs = list(range(n * max(views, 1)))  # pair p = view * n + sample
    mine = pairs[env.rank::env.world]
    parts = {}
    for start in range(0, len(mine), batch_size):
        chunk = mine[start:start + batch_size]
        samples = [p % n for p in chunk]
        batch = dataset.batch(samples, views=[p // n for p in chunk]) if views else dataset.batch(samples)
        for key, value in teacher(inputs(batch.x)).items():
            parts.setdefault(key, []).append(value.float().cpu())
    shard = {k: torch.cat(v) for k, v in parts.items()}
    if not env.distributed:
        return TeacherCache(shard, n, views)
    total = len(pairs)
    rows = -(-total // env.world)  # every rank pads its shard to the same row count for all_gather
    full = {}
    for key, value in shard.items():
        padded = torch.zeros((rows, *value.shape[1:]), dtype=value.dtype)
        padded[:len(value)] = value
        gathered = [torch.zeros_like(padded) for _ in range(env.world)]
        if env.backend == "nccl":
            gathered = [g.to(env.device) for g in gathered]
            padded = padded.to(env.device)
        torch.distributed.all_gather(gathered, padded)
        out = torch.zeros((total, *value.shape[1:]), dtype=value.dtype)
        for r, g in enumerate(gathered):
            out[r::env.world] = g[:len(range(r, total, env.world))].cpu()
        full[key] = out
    return TeacherCache(full, n, views)


def probe_shapes(student, teacher, example):
    """Feature shapes (without batch) of the tapped layers, from one forward pass in eval mode."""
    was_training = student.training
    student.eval()
    with torch.no_grad():
        student(example)
        teacher.model(example)
    student.train(was_training)
    shapes = {("student", k): tuple(v.shape[1:]) for k, v in student.tap.outputs.items()}
    shapes.update({("teacher", k): tuple(v.shape[1:]) for k, v in teacher.tap.outputs.items()})
    return shapes
