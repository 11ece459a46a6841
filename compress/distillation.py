"""The pieces of distillation that hold state: the student with its training-only regressor, the frozen
teacher's outputs, and the teacher-output cache.

The teacher is frozen and in eval mode, so when training batches are not augmented its outputs for a sample
never change: `build_cache` computes them once (each rank a strided shard, then all-gathered) and every epoch
looks them up by sample index instead of running the teacher. With augmentation the teacher runs per batch.
"""

import logging

import torch
from torch import nn

from compress.data import eval_loader
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
    """Teacher outputs for every training sample, indexed by sample index (kept on the CPU)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def lookup(self, indices, device):
        return {k: v[indices].to(device, non_blocking=True) for k, v in self.tensors.items()}

    def nbytes(self):
        return sum(v.numel() * v.element_size() for v in self.tensors.values())


@torch.no_grad()
def build_cache(teacher, dataset, env, batch_size):
    """Run the teacher once over the un-augmented training set: each rank a strided shard, then all-gather."""
    loader = eval_loader(dataset, batch_size, env.rank, env.world)
    parts = {}
    for x, _, _ in loader:
        for key, value in teacher(x.to(env.device)).items():
            parts.setdefault(key, []).append(value.cpu())
    shard = {k: torch.cat(v) for k, v in parts.items()}
    if not env.distributed:
        return TeacherCache(shard)
    n = len(dataset)
    rows = -(-n // env.world)  # every rank pads its shard to the same row count for all_gather
    full = {}
    for key, value in shard.items():
        padded = torch.zeros((rows, *value.shape[1:]), dtype=value.dtype)
        padded[:len(value)] = value
        gathered = [torch.zeros_like(padded) for _ in range(env.world)]
        if env.backend == "nccl":
            gathered = [g.to(env.device) for g in gathered]
            padded = padded.to(env.device)
        torch.distributed.all_gather(gathered, padded)
        out = torch.zeros((n, *value.shape[1:]), dtype=value.dtype)
        for r, g in enumerate(gathered):
            count = len(range(r, n, env.world))
            out[r::env.world] = g[:count].cpu()
        full[key] = out
    return TeacherCache(full)


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
