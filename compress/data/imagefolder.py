"""Users' own images: an image-folder tree (root/train/<class>/ with root/val/<class>/ or test/, or one flat
root/<class>/ tree split by seed), and a folder of unlabelled images for distillation (nested folders allowed)."""

import os

import torch

from compress.data.builtin import _split, augment_of
from compress.data.imageset import UNLABELLED, FileImages, ImageSet
from compress.data.registry import input_shape_of
from compress.deploy import imageio
from compress.errors import InputError

SPLIT_FOLDERS = ("val", "test")


def load_imagefolder(cfg, seed):
    """root/<class>/<image> split by data.split_seed, or root/train/<class>/... with root/val/ (or test/)."""
    root = os.path.expanduser(cfg.root)
    held_out = next((s for s in SPLIT_FOLDERS if os.path.isdir(os.path.join(root, s))), None)
    if os.path.isdir(os.path.join(root, "train")) and held_out:
        names, train = _class_tree(os.path.join(root, "train"))
        val_names, val = _class_tree(os.path.join(root, held_out))
        _same_classes(root, names, val_names, held_out)
        if cfg.limit:  # a seeded sample of the training folder
            keep = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.split_seed))[:cfg.limit]
            train = [train[i] for i in sorted(keep.tolist())]
        how = f"folders train/ and {held_out}/: {len(train)}/{len(val)} images"
    else:
        names, samples = _class_tree(root)
        train_idx, val_idx = _split(len(samples), cfg.val_fraction, cfg.split_seed)
        train_idx = train_idx[:cfg.limit] if cfg.limit else train_idx
        train, val = [samples[i] for i in train_idx], [samples[i] for i in val_idx]
        how = f"{len(samples)} images split {len(train)}/{len(val)} by data.split_seed (no train/ and val/ folders)"
    channels, size, _ = input_shape_of(cfg)
    rule = imageio.resize_rule(size, cfg.eval_crop)
    budget = cfg.cache_mb * 2**20

    augment = augment_of(cfg, seed, True)

    def subset(items, augment):
        storage = FileImages([p for p, _ in items], (channels, size, size), rule,
                             keep_original=augment is not None and augment.kind == "random_resized_crop",
                             cache_bytes=budget)
        return ImageSet([label for _, label in items], (channels, size, size), storage, augment, rule)

    return subset(train, augment), subset(val, None), tuple(names), how


def _class_tree(root):
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if len(names) < 2:
        raise InputError(f"data.root '{root}' must hold one folder per class (<class>/<image>); found {len(names)} "
                         "class folder(s)")
    try:
        samples = make_dataset(root, {n: i for i, n in enumerate(names)}, extensions=IMG_EXTENSIONS)
    except FileNotFoundError as e:
        raise InputError(f"data.root '{root}': {e}") from None
    return names, samples


def _same_classes(root, train_names, val_names, held_out):
    only_train = sorted(set(train_names) - set(val_names))
    only_val = sorted(set(val_names) - set(train_names))
    if only_train or only_val:
        which = (f"class '{only_train[0]}' is in train/ but not in {held_out}/" if only_train
                 else f"class '{only_val[0]}' is in {held_out}/ but not in train/")
        raise InputError(f"data.root '{root}': {which}; both splits need the same class folders")


def image_files(root):
    """Every image file under `root` (nested folders included, hidden ones skipped), sorted."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    found = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(folder, f) for f in sorted(files)
                     if not f.startswith(".") and f.lower().endswith(IMG_EXTENSIONS))
    return found


def load_unlabeled(cfg, train):
    """data.unlabeled's images as a set with label -1, at the training images' shape and eval rule (decoded
    once into memory when they fit data.cache_mb, so an unreadable file is found here, naming it)."""
    root = os.path.expanduser(cfg.unlabeled)
    if not os.path.isdir(root):
        raise InputError(f"data.unlabeled: folder '{cfg.unlabeled}' does not exist; point it at a folder of images")
    files = image_files(root)
    if not files:
        raise InputError(f"data.unlabeled: folder '{cfg.unlabeled}' holds no image files (.jpg, .png, .bmp, ...); "
                         "point it at a folder of images")
    storage = FileImages(files, train.image_shape, train.rule,
                         keep_original=train.augment.kind == "random_resized_crop", cache_bytes=cfg.cache_mb * 2**20)
    return ImageSet([UNLABELLED] * len(files), train.image_shape, storage, train.augment, train.rule)
