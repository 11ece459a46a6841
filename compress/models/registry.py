"""The model registry: name -> builder(in_channels, image_size, num_classes) -> nn.Module, and the one function
that builds any model name the config can hold (a registry name, `torchvision:<builder>`, `<module>:<function>`).
"""

import difflib
from typing import Callable, NamedTuple

from compress.models import sources
from compress.models.architectures import (
    CifarResNet,
    CompactCNN,
    DeepCNN,
    LightCNN,
    PhotoResNet,
    _mobilenet_v2,
    _resnet18,
)

MODELS = {
    "deep_cnn": lambda c, s, n: DeepCNN(c, s, n),
    "light_cnn": lambda c, s, n: LightCNN(c, s, n),
    "compact_cnn": lambda c, s, n: CompactCNN(c, s, n),
    "resnet8": lambda c, s, n: CifarResNet(c, n, n=1),
    "resnet14": lambda c, s, n: CifarResNet(c, n, n=2),
    "resnet20": lambda c, s, n: CifarResNet(c, n, n=3),
    "resnet18": lambda c, s, n: _resnet18(c, s, n),
    "mobilenet_v2": lambda c, s, n: _mobilenet_v2(c, s, n),
    "resnet18_half": lambda c, s, n: PhotoResNet(c, n, depths=(2, 2, 2, 2), width=32),
    "resnet10_half": lambda c, s, n: PhotoResNet(c, n, depths=(1, 1, 1, 1), width=32),
    "quantizable_resnet18": lambda c, s, n: _resnet18(c, s, n, quantizable=True),
    "quantizable_mobilenet_v2": lambda c, s, n: _mobilenet_v2(c, s, n, quantizable=True),
}

DESCRIPTIONS = {
    "deep_cnn": "KD-tutorial teacher: 4 convs (128, 64, 64, 32), 2 pools, MLP 512",
    "light_cnn": "KD-tutorial student: 2 convs (16, 16), 2 pools, MLP 256",
    "compact_cnn": "int8-friendly student: conv-BN-ReLU x3 (32, 64, 64), global pool, linear",
    "resnet8": "CIFAR ResNet-8 (He et al. 2016): 3 stages of 1 basic block, 16/32/64 wide, 78k parameters",
    "resnet14": "CIFAR ResNet-14: 3 stages of 2 basic blocks, 16/32/64 wide, 175k parameters",
    "resnet20": "CIFAR ResNet-20: 3 stages of 3 basic blocks, 16/32/64 wide, 272k parameters",
    "resnet18": "torchvision resnet18 (CIFAR-style stem below 64 px)",
    "mobilenet_v2": "torchvision mobilenet_v2 (stride-1 stem below 64 px)",
    "resnet18_half": "photo student: resnet18's layout at half the width (32-256 channels), 2.8M parameters; "
                     "int8 1.6-2.3x faster than fp32 in onnxruntime",
    "resnet10_half": "photo student (the photos recipe's): one basic block per stage, 32-256 channels, 1.2M "
                     "parameters; int8 (stem float) 2.3x faster than fp32 in onnxruntime at batch 64 on 2 "
                     "threads, 2.5-3x on 1",
    "quantizable_resnet18": "torchvision.models.quantization resnet18 (quant stubs, FloatFunctional adds)",
    "quantizable_mobilenet_v2": "torchvision.models.quantization mobilenet_v2",
}


def _no_code(name):
    return ""


class Source(NamedTuple):
    """One way a model name is read: its syntax, a name it reads (`example`, checked by a test), and, for a name it
    `matches`, how to `build` it, why it cannot be built (`problem`: a sentence, or None) and a digest of the
    user's code behind it (`digest`: '' when there is none; a stage that builds the model reruns when it
    changes). `fallback`: tried only after every other source declined the name (`<module>:<function>` reads any
    name with a colon, so a new source with a prefix of its own is asked first)."""

    syntax: str
    summary: str
    example: str
    matches: Callable
    build: Callable  # build(name, channels, (height, width), num_classes) -> nn.Module
    problem: Callable
    digest: Callable = _no_code
    fallback: bool = False


def _registry_problem(name):
    close = difflib.get_close_matches(name, list(MODELS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (f"unknown model '{name}'{hint}; choose one of {', '.join(MODELS)}, or "
            + ", or ".join(s.syntax for key, s in SOURCES.items() if key != "registry"))


# How model.teacher / model.student are read: the first source whose `matches` accepts the name builds it (the
# fallback last).
SOURCES = {
    "registry": Source("<name>", "a model of compress's registry (`compress models`)", "resnet18_half",
                       lambda n: ":" not in n, lambda n, c, s, k: MODELS[n](c, s, k),
                       lambda n: None if n in MODELS else _registry_problem(n)),
    "torchvision": Source("torchvision:<builder>", "any torchvision classification model, e.g. torchvision:resnet50 "
                                                   "(first conv and classifier adapted to your channels and classes; "
                                                   "ImageNet weights: model.*_weights=pretrained)",
                          "torchvision:resnet18", lambda n: n.startswith(sources.TORCHVISION),
                          sources.build_torchvision, sources.torchvision_problem),
    "code": Source("<module>:<function>", "your own code: called with the keyword arguments it names of "
                                          "num_classes, in_channels, image_size (height, width); returns an "
                                          "nn.Module",
                   "mymodels:tiny", lambda n: ":" in n, sources.build_user_model, sources.user_code_problem,
                   digest=sources.code_digest, fallback=True),
}


def source_of(name):
    """The SOURCES entry that reads `name`."""
    return next(source for source in sorted(SOURCES.values(), key=lambda s: s.fallback) if source.matches(name))


def build_model(name, input_shape, num_classes):
    """Build a model (a registry name, torchvision:<builder> or module:function: SOURCES) for (channels, height,
    width) inputs with a deterministic initialisation (callers seed torch first)."""
    channels, height, width = input_shape
    return source_of(name).build(name, channels, (height, width), num_classes)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def source_problem(name):
    """Why `name` cannot be built, or None (checked before anything is written)."""
    return source_of(name).problem(name)
