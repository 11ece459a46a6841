"""Model registry: name -> builder(in_channels, image_size, num_classes) -> nn.Module.

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


MODELS = {
    "deep_cnn": lambda c, s, n: DeepCNN(c, s, n),
    "light_cnn": lambda c, s, n: LightCNN(c, s, n),
    "compact_cnn": lambda c, s, n: CompactCNN(c, s, n),
    "resnet18": lambda c, s, n: _resnet18(c, s, n),
    "mobilenet_v2": lambda c, s, n: _mobilenet_v2(c, s, n),
    "quantizable_resnet18": lambda c, s, n: _resnet18(c, s, n, quantizable=True),
    "quantizable_mobilenet_v2": lambda c, s, n: _mobilenet_v2(c, s, n, quantizable=True),
}

DESCRIPTIONS = {
    "deep_cnn": "KD-tutorial teacher: 4 convs (128, 64, 64, 32), 2 pools, MLP 512",
    "light_cnn": "KD-tutorial student: 2 convs (16, 16), 2 pools, MLP 256",
    "compact_cnn": "int8-friendly student: conv-BN-ReLU x3 (32, 64, 64), global pool, linear",
    "resnet18": "torchvision resnet18 (CIFAR-style stem below 64 px)",
    "mobilenet_v2": "torchvision mobilenet_v2 (stride-1 stem below 64 px)",
    "quantizable_resnet18": "torchvision.models.quantization resnet18 (quant stubs, FloatFunctional adds)",
    "quantizable_mobilenet_v2": "torchvision.models.quantization mobilenet_v2",
}


def source_problem(name):
    """Why `name` (model.teacher / model.student) cannot be built, or None."""
    if name in MODELS:
        return None
    import difflib

    close = difflib.get_close_matches(name, list(MODELS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown model '{name}'{hint}; choose one of {', '.join(MODELS)}"


def build_model(name, input_shape, num_classes):
    """Build a registry model for (channels, height, width) inputs with a deterministic initialisation
    (callers seed torch first)."""
    channels, height, width = input_shape
    return MODELS[name](channels, (height, width), num_classes)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())
