"""Optimizers and learning-rate schedules, from the plain values of a stage's config section."""

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("cosine", "step", "constant")


def build_optimizer(params, ocfg):
    """The stage's optimizer; with `norm_weight_decay` set, the 1-D parameters (normalisation scales and shifts,
    biases) decay by it instead of `weight_decay`."""
    params = [p for p in params if p.requires_grad]
    norm_decay = getattr(ocfg, "norm_weight_decay", None)
    if norm_decay is not None:
        params = [{"params": [p for p in params if p.ndim > 1]},
                  {"params": [p for p in params if p.ndim <= 1], "weight_decay": norm_decay}]
    if ocfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=ocfg.lr, momentum=ocfg.momentum, weight_decay=ocfg.weight_decay,
                               nesterov=ocfg.nesterov and ocfg.momentum > 0)
    if ocfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=ocfg.lr, weight_decay=ocfg.weight_decay)
    return torch.optim.Adam(params, lr=ocfg.lr, weight_decay=ocfg.weight_decay)


@dataclass(frozen=True)
class Schedule:
    """The learning rate as a pure function of the global step: a linear warm-up from 0 over `warmup_epochs`,
    then cosine to 0 at the last step, a decay by `gamma` every `step_size` epochs, or flat."""

    kind: str
    lr: float
    epochs: int
    steps_per_epoch: int
    warmup_epochs: float = 0.0
    step_size: int = 1
    gamma: float = 0.1

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule '{self.kind}'; choose one of {', '.join(SCHEDULES)}")

    @classmethod
    def from_config(cls, ocfg, steps_per_epoch):
        return cls(ocfg.schedule, ocfg.lr, ocfg.epochs, steps_per_epoch, ocfg.warmup_epochs, ocfg.step_size,
                   ocfg.gamma)

    @property
    def total_steps(self):
        return self.epochs * self.steps_per_epoch

    def lr_at(self, step):
        warmup = round(self.warmup_epochs * self.steps_per_epoch)
        if step < warmup:
            return self.lr * (step + 1) / warmup
        if self.kind == "cosine":
            total = max(self.total_steps - warmup, 1)
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / total))
        if self.kind == "step":
            return self.lr * self.gamma ** ((step // self.steps_per_epoch) // self.step_size)
        return self.lr
