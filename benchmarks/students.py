"""Students for capacity probes, loaded the way users load their own models (`model.student=
benchmarks.students:<function>`, run from the repository root): the recipe's `compact_cnn` at a wider width,
the same layers and int8-friendly shape.

    python benchmarks/bench_kd_table.py ... --variant "+wide2=model.student=benchmarks.students:compact_cnn_x2"
"""

import torch
from torch import nn

from compress.models.architectures import PhotoResNet, conv_bn_relu


class WideCompactCNN(nn.Module):
    """`compact_cnn` (conv-BN-ReLU 32/64/64, global pool, linear) with every width times `k`."""

    def __init__(self, in_channels, num_classes, k):
        super().__init__()
        a, b = 32 * k, 64 * k
        self.stem = conv_bn_relu(in_channels, a, stride=2)
        self.block1 = nn.Sequential(conv_bn_relu(a, b), nn.MaxPool2d(2))
        self.block2 = conv_bn_relu(b, b)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(b, num_classes)

    def forward(self, x):
        x = self.block2(self.block1(self.stem(x)))
        return self.classifier(torch.flatten(self.pool(x), 1))


def compact_cnn_x2(num_classes, in_channels):
    """64/128/128 wide: 4x the parameters (225k) and the multiply-adds of `compact_cnn`."""
    return WideCompactCNN(in_channels, num_classes, 2)


def resnet10_quarter(num_classes, in_channels):
    """The photos recipe's `resnet10_half` at half its width again (16-128 channels): 0.3M parameters."""
    return PhotoResNet(in_channels, num_classes, depths=(1, 1, 1, 1), width=16)
