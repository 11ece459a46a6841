"""Teachers for the stronger-teacher probe of issue 23, loaded the way users load their own models
(`model.teacher=benchmarks.teachers:<function>`, run from the repository root), with `teacher.epochs=0` and
`model.teacher_weights` pointing at a file this script writes from teachers the product trained:

    python benchmarks/teachers.py combine /tmp/ens/resnet20_x3.safetensors \\
        /tmp/kdtable/run/teacher/model.safetensors /tmp/ens/t1/teacher/model.safetensors \\
        /tmp/ens/t2/teacher/model.safetensors
    python benchmarks/bench_kd_table.py ... --set model.teacher=benchmarks.teachers:resnet20_x3 \\
        --set model.teacher_weights=/tmp/ens/resnet20_x3.safetensors --set teacher.epochs=0 ...

An ensemble of independently trained copies of the recipe's teacher is the stronger teacher this data allows:
on these 10,000 photos a deeper or wider single network was no better than the cutmix-trained `resnet20`
(the GPU probe's teachers in BENCHMARKS.md).
"""

import argparse
import os

import torch
from torch import nn

from compress.fileio import atomic_write_bytes
from compress.models.registry import MODELS


class LogitEnsemble(nn.Module):
    """The mean of its members' logits (the geometric mean of their softmax outputs, renormalised)."""

    def __init__(self, members):
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, x):
        return torch.stack([m(x) for m in self.members]).mean(0)


def resnet20_x3(num_classes, in_channels, image_size):
    """Three CIFAR ResNet-20s (3 x 272k parameters), logits averaged."""
    return LogitEnsemble([MODELS["resnet20"](in_channels, image_size, num_classes) for _ in range(3)])


def combine(out, members):
    """One safetensors file for a LogitEnsemble from its members' files (`members.<i>.<key>`)."""
    from safetensors.torch import load_file, save

    state = {f"members.{i}.{k}": v for i, path in enumerate(members) for k, v in load_file(path).items()}
    atomic_write_bytes(out, save(state))
    return len(state)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("combine", help="write one ensemble weights file from its members' safetensors files")
    c.add_argument("out")
    c.add_argument("members", nargs="+")
    args = p.parse_args()
    missing = [m for m in args.members if not os.path.isfile(m)]
    if missing:
        p.error(f"member weights file '{missing[0]}' not found; pass each teacher's model.safetensors")
    n = combine(args.out, args.members)
    print(f"{args.out}: {n} tensors from {len(args.members)} members")


if __name__ == "__main__":
    main()
