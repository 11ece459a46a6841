"""Loading a dataset: the built-in ones (mnist5k, digits, cifar10) and the bundle every loader returns - a
training and a validation split, class names, normalisation (given, or computed on the training split), the
eval-time resize rule, and for distillation an optional set of unlabelled images. `load_data` is the entry.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from compress.data.imageset import ImageSet
from compress.data.registry import loader
from compress.errors import InputError

log = logging.getLogger(__name__)

STATS_SAMPLES = 5000  # images used to compute mean/std for lazily loaded datasets

@dataclass
class DataBundle:
    name: str
    train: "ImageSet"
    val: "ImageSet"
    class_names: tuple
    mean: tuple
    std: tuple
    resize: dict = field(default_factory=dict)  # the eval-time resize rule (compress.deploy.imageio.resize_rule)
    layout: str = ""  # how the splits were found, in words (for the data summary)
    unlabeled: Optional[ImageSet] = None  # images without labels (data.unlabeled), when asked for

    @property
    def num_classes(self):
        return len(self.class_names)

    @property
    def input_shape(self):
        """(channels, height, width) of one normalised image."""
        return self.train.image_shape


def num_classes_of(cfg):
    """How many classes the config's dataset has, without reading images (imagefolder: its class folders)."""
    if cfg.name != "imagefolder":
        return 10
    root = os.path.expanduser(cfg.root)
    top = os.path.join(root, "train") if os.path.isdir(os.path.join(root, "train")) else root
    try:
        return max(2, sum(1 for e in os.scandir(top) if e.is_dir() and not e.name.startswith(".")))
    except OSError:
        return 2


def load_data(cfg, seed, unlabeled=False):
    """Build the train/val splits for `cfg` (a DataConfig) and attach normalisation (given, or computed on the
    training split). `seed` seeds the training augmentation; `unlabeled` also loads data.unlabeled's images."""
    train, val, class_names, how = loader(cfg.name)(cfg, seed)
    if len(train) == 0 or len(val) == 0:
        raise InputError(f"data: the {'training' if len(train) == 0 else 'validation'} split of {cfg.name} is "
                         "empty; add images or change data.val_fraction")
    if cfg.mean is not None:
        mean, std = tuple(cfg.mean), tuple(cfg.std)
        if len(mean) != train.image_shape[0]:
            raise InputError(f"data.mean has {len(mean)} values but the images have {train.image_shape[0]} "
                             "channel(s)")
    else:
        mean, std = channel_stats(train)
    extra = None
    if unlabeled and cfg.unlabeled:
        from compress.data.imagefolder import load_unlabeled

        extra = load_unlabeled(cfg, train)
    for split in (train, val, extra):
        if split is not None:
            split.normalise_with(mean, std)
    log.debug("data %s: %s, shape %s", cfg.name, how, train.image_shape)
    return DataBundle(cfg.name, train, val, class_names, mean, std, dict(val.rule), how, extra)


def channel_stats(dataset):
    """Per-channel mean/std of the (un-normalised, un-augmented) images in [0, 1]."""
    n = min(len(dataset), STATS_SAMPLES)
    idx = torch.linspace(0, len(dataset) - 1, n).round().long().tolist()
    images, _ = dataset.raw(idx)
    x = images.double().div(255.0).transpose(0, 1).reshape(images.shape[1], -1)
    mean, std = x.mean(dim=1), x.std(dim=1).clamp_min(1e-6)
    return tuple(round(v, 6) for v in mean.tolist()), tuple(round(v, 6) for v in std.tolist())
