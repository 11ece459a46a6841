"""The registry's own architectures: the KD tutorial's pair, an int8-friendly student, the CIFAR ResNets, and
torchvision's resnet18 / mobilenet_v2 adapted to small images and any channel count.

Every model here must be FX-traceable (QAT needs it; a test checks). Hidden features for distillation are
taken from these unmodified models with forward hooks, by module name (`features`, `layer4`, ...).
"""

import torch
from torch import nn


class DeepCNN(nn.Module):
    """The teacher of the PyTorch knowledge-distillation tutorial: 4 convs (128, 64, 64, 32), 2 max-pools,
    classifier (32*H/4*W/4) -> 512 -> classes with dropout 0.1. 2048 -> 512 on 32x32 CIFAR-10."""

    def __init__(self, in_channels=3, image_size=(32, 32), num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 128, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(128, 64, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(64, 64, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 32, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        flat = 32 * (image_size[0] // 4) * (image_size[1] // 4)
        self.classifier = nn.Sequential(
            nn.Linear(flat, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class LightCNN(nn.Module):
    """The tutorial's student: 2 convs (16, 16), 2 max-pools, classifier (16*H/4*W/4) -> 256 -> classes."""

    def __init__(self, in_channels=3, image_size=(32, 32), num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(16, 16, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        flat = 16 * (image_size[0] // 4) * (image_size[1] // 4)
        self.classifier = nn.Sequential(
            nn.Linear(flat, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def conv_bn_relu(in_channels, out_channels, stride=1):
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU())


class CompactCNN(nn.Module):
    """A student built for int8 deployment: a stride-2 stem, conv-BN-ReLU blocks (32, 64, 64), global
    average pooling, one linear layer. BN folds into the convs during QAT, every layer has enough channels
    for int8 kernels to pay off, and the 7x7 map of `block2` lines up with DeepCNN's `features` for hints."""

    def __init__(self, in_channels=3, image_size=(32, 32), num_classes=10):
        super().__init__()
        self.stem = conv_bn_relu(in_channels, 32, stride=2)
        self.block1 = nn.Sequential(conv_bn_relu(32, 64), nn.MaxPool2d(2))
        self.block2 = conv_bn_relu(64, 64)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.block2(self.block1(self.stem(x)))
        return self.classifier(torch.flatten(self.pool(x), 1))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv-BN, ReLU, a 1x1 conv-BN shortcut when the shape changes."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """The CIFAR ResNets of He et al. 2016 (section 4.2): a 3x3 stem, three stages of n basic blocks at widths
    16, 32, 64 (stride 2 between stages), global average pooling, one linear layer; 6n+2 layers. Small enough
    to train on a CPU, strong enough on 32x32 images to teach the small students."""

    def __init__(self, in_channels=3, num_classes=10, n=2, width=16):
        super().__init__()
        self.stem = conv_bn_relu(in_channels, width)
        blocks, channels = [], width
        for stage, out in enumerate((width, 2 * width, 4 * width)):
            for b in range(n):
                blocks.append(BasicBlock(channels, out, 2 if stage > 0 and b == 0 else 1))
                channels = out
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class PhotoResNet(nn.Module):
    """A ResNet of basic blocks laid out for photos (ImageNet's layout: a stride-2 stem and a max-pool, then four
    stages at widths w, 2w, 4w, 8w, stride 2 between them), with `depths` blocks per stage: narrower and shallower
    than resnet18 to be a student whose int8 form is fast in onnxruntime - plain 3x3 convolutions with enough
    channels for int8 kernels, no depthwise ones (those gain nothing from int8 on a CPU: BENCHMARKS.md)."""

    def __init__(self, in_channels=3, num_classes=10, depths=(1, 1, 1, 1), width=32):
        super().__init__()
        self.stem = nn.Sequential(conv_bn_relu(in_channels, width, stride=2), nn.MaxPool2d(3, 2, 1))
        channels = width
        for i, depth in enumerate(depths):
            out = width * 2 ** i
            blocks = [BasicBlock(channels if b == 0 else out, out, 2 if i > 0 and b == 0 else 1) for b in range(depth)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            channels = out
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.classifier(torch.flatten(self.pool(x), 1))


def _small_input(image_size):
    # ImageNet stems shrink 224px by 4 before the first block; on 32px or smaller images that throws away
    # most of the signal, so small inputs get the CIFAR-style stem (3x3, stride 1, no max-pool).
    return max(image_size) < 64


def _resnet18(in_channels, image_size, num_classes, quantizable=False):
    if quantizable:
        from torchvision.models.quantization import resnet18 as build
        model = build(weights=None, quantize=False, num_classes=num_classes)
    else:
        from torchvision.models import resnet18 as build
        model = build(weights=None, num_classes=num_classes)
    if _small_input(image_size):
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def _mobilenet_v2(in_channels, image_size, num_classes, quantizable=False):
    if quantizable:
        from torchvision.models.quantization import mobilenet_v2 as build
        model = build(weights=None, quantize=False, num_classes=num_classes)
    else:
        from torchvision.models import mobilenet_v2 as build
        model = build(weights=None, num_classes=num_classes)
    stem = model.features[0][0]
    stride = 1 if _small_input(image_size) else 2
    if in_channels != 3 or stride != 2:
        model.features[0][0] = nn.Conv2d(in_channels, stem.out_channels, 3, stride=stride, padding=1, bias=False)
    return model
