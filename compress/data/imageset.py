"""Images served a whole batch at a time, augmented reproducibly, normalised per batch.

Every dataset is indexed by a *batch request* `(epoch, [sample indices])` and returns a whole Batch, so
in-memory datasets are sliced in one tensor operation and never bottleneck training; the epoch travels with
the request, so augmentation (seeded per sample, `compress.data.transforms`) is the same in a DataLoader
worker, on another DDP rank, or after a resume. The sample indices and views travel with the batch so the
distill stage can look up the teacher's stored outputs.

Where the pixels live is a storage: a uint8 tensor in memory, image files (decoded per batch, or once into
memory when they fit), or several of these one after the other (labelled and unlabelled images in one set).
An unlabelled sample has label -1.
"""

import copy
import hashlib
import json
import logging
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from compress.data import pixels, transforms
from compress.deploy import imageio
from compress.fileio import sha256_file

log = logging.getLogger(__name__)

UNLABELLED = -1
FINGERPRINT_BYTES = 256 * 2**20  # image bytes read for a folder's fingerprint (all of them below this)


class Batch(NamedTuple):
    """What every loader yields: normalised images, labels (-1: unlabelled), the dataset indices of the samples,
    which fixed augmented view each shows (-1: augmented afresh each epoch, or not at all), and for mixing the
    partner's label and the share of the image that is the sample's own (1 without mixing)."""

    x: torch.Tensor
    y: torch.Tensor
    index: torch.Tensor
    view: torch.Tensor
    partner_y: torch.Tensor
    own: torch.Tensor


@dataclass(frozen=True)
class Augment:
    """The training augmentation of a split (see compress.data.transforms). `seed` seeds fresh per-epoch
    augmentation; with `views` > 0 each image has that many fixed views seeded by `view_seed` instead, and
    epoch e shows view e mod views."""

    kind: str = "none"  # none | pad_crop | random_resized_crop
    flip: bool = False
    padding: int = 4
    scale: tuple = (0.25, 1.0)
    seed: int = 0
    views: int = 0
    view_seed: int = 0
    mix: str = "none"  # none | mixup | cutmix
    mix_alpha: float = 1.0

    @property
    def active(self):
        return self.kind != "none" or self.flip or self.mix != "none"

    def key(self, epoch, index, view):
        return transforms.augmentation_key(self.view_seed if view >= 0 else self.seed, epoch, index, view)


# ---------------------------------------------------------------- storages


class TensorImages:
    """uint8 (N, C, H, W) in memory, at the model's size."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def source(self, i):
        return self.images[i]

    def fitted(self, indices):
        return self.images[torch.as_tensor(indices, dtype=torch.long)]

    def fingerprint(self, h):
        h.update(self.images.contiguous().numpy().tobytes())


def _absolute(files):
    """(os.path.abspath of each file, the folders they are in), made once per folder instead of once per file
    (ImageNet: 1.28 M files in 1,000 folders)."""
    folders, found = {}, []
    for path in files:
        folder, name = os.path.split(path)
        prefix = folders.get(folder)
        if prefix is None:
            prefix = folders[folder] = os.path.join(os.path.abspath(folder), "")
        found.append(prefix + name if name not in ("", ".", "..") else os.path.abspath(path))
    return found, [os.path.dirname(p) for p in folders.values()]


class FileImages:
    """One image file per sample, decoded once (`compress.data.pixels`): at the rule's size, or - with
    `keep_original` (random_resized_crop crops from the whole image) - whole, at the shorter side training
    needs. The pixels are held in memory up to `cache_bytes`, else memory-mapped from the run's cache (`place`);
    without a cache folder and over the budget they are decoded every batch, and `how` says what fixes that."""

    def __init__(self, files, image_shape, rule, keep_original=False, cache_bytes=0, place=None, role="train"):
        self.files, self.image_shape, self.keep_original = list(files), tuple(image_shape), keep_original
        self.rule = rule or imageio.resize_rule(self.image_shape[-1])
        self.held_rule = pixels.keep_aspect(pixels.train_side(self.image_shape[-1], self.rule["shorter_side"])) \
            if keep_original else self.rule
        self._parts = None
        self.pixels, self.how = None, ""
        if self.files:
            digest = self.digest() if place is not None else None
            self.pixels, self.how = pixels.hold(self.files, self.image_shape[0], self.held_rule, cache_bytes, place,
                                                role, digest)
            log.info("data: %s", self.how)

    def __len__(self):
        return len(self.files)

    def source(self, i):
        """Image i, decoded: held since loading, or decoded now."""
        return self.pixels[i] if self.pixels is not None else self._decode(i)

    def fitted(self, indices):
        return torch.stack([self._fit(self.source(int(i))) for i in indices])

    def fingerprint(self, h):
        """Each file's path below the folder all the files share, its size, and its bytes: every file's when
        they add up to at most FINGERPRINT_BYTES, else those of evenly spaced files within that budget (for
        ImageNet's 1.28M training files about 1 in 550, a second or two of reading). Not the modification
        time and not the absolute path: the same images copied elsewhere (to a node's local disk, a re-synced
        share, a restored backup) keep the teacher-output store and the decoded pixels built for them. Read
        once per set; later calls replay what was read."""
        if not self.files:
            return
        if self._parts is None:
            self._parts = self._read_fingerprint()
        for part in self._parts:
            h.update(part)

    def digest(self):
        """The fingerprint as hex digits (the pixel cache's key for these files)."""
        h = hashlib.sha256()
        self.fingerprint(h)
        return h.hexdigest()

    def _read_fingerprint(self):
        paths, folders = _absolute(self.files)
        root = os.path.commonpath(folders)  # the files' common folder (found from their folders: 5 s less at 1.28 M)
        start = len(os.path.join(root, ""))  # each path below root, as os.path.relpath gives it (13 s at 1.28 M)
        sizes = [os.stat(p).st_size for p in paths]
        parts = ["".join(f"{path[start:]}|{size}\n" for path, size in zip(paths, sizes)).encode("utf-8",
                                                                                               "surrogateescape")]
        step = max(1, -(-sum(sizes) // FINGERPRINT_BYTES))
        for path in paths[::step]:
            parts.append(bytes.fromhex(sha256_file(path, follow_links=True, what="image")))  # in blocks, a pipe refused
        return parts

    def _decode(self, i):
        return torch.from_numpy(pixels.decode(self.files[i], self.image_shape[0], self.held_rule))

    def _fit(self, image):
        """`image` at the model's size by the rule: held so already, or (kept whole) resized and cropped - one
        already at the model's size too, unless the rule leaves it as it is (data.eval_crop 1)."""
        if tuple(image.shape) == self.image_shape and (
                not self.keep_original or self.rule["shorter_side"] == self.image_shape[-1]):
            return image
        from PIL import Image

        pil = Image.fromarray(image.permute(1, 2, 0).squeeze(-1).numpy())
        return _to_tensor(imageio.resize_and_crop(pil, self.rule), self.image_shape[0])


class ConcatImages:
    """Several storages one after the other (index i of the whole is index i - offset of its part)."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.offsets = [0]
        for part in self.parts:
            self.offsets.append(self.offsets[-1] + len(part))

    def __len__(self):
        return self.offsets[-1]

    def _locate(self, i):
        for p, part in enumerate(self.parts):
            if i < self.offsets[p + 1]:
                return part, i - self.offsets[p]
        raise IndexError(i)

    def source(self, i):
        part, j = self._locate(int(i))
        return part.source(j)

    def fitted(self, indices):
        return torch.stack([part.fitted([j])[0] for part, j in map(self._locate, map(int, indices))])

    def fingerprint(self, h):
        for part in self.parts:
            h.update(f"part of {len(part)}".encode())
            part.fingerprint(h)


# ---------------------------------------------------------------- the dataset


class ImageSet(torch.utils.data.Dataset):
    """Images and labels served a whole batch at a time (see the module docstring). Never changed in place
    after loading: `with_augment` and `concat` return new sets."""

    def __init__(self, labels, image_shape, storage, augment=None, rule=None):
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.image_shape = tuple(image_shape)
        self.storage = storage
        self.augment = augment or Augment()
        self.rule = rule or imageio.resize_rule(self.image_shape[-1])
        self.mean = self.std = None

    def __len__(self):
        return len(self.labels)

    @property
    def images(self):
        """The uint8 tensor of an in-memory set (None for image files)."""
        return self.storage.images if isinstance(self.storage, TensorImages) else None

    @property
    def files(self):
        """The image files of a file-based set (None in memory)."""
        return self.storage.files if isinstance(self.storage, FileImages) else None

    @property
    def labelled(self):
        return int((self.labels >= 0).sum())

    def normalise_with(self, mean, std):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def with_augment(self, **changes):
        """A copy of this set with some augmentation fields changed (the images are shared, not copied)."""
        other = copy.copy(self)
        other.augment = replace(self.augment, **changes)
        return other

    def concat(self, other):
        """This set followed by `other` (same image shape), with this set's augmentation and normalisation."""
        joined = copy.copy(self)
        joined.labels = torch.cat([self.labels, other.labels])
        joined.storage = ConcatImages([self.storage, other.storage])
        return joined

    def batch(self, indices, epoch=None, views=None):
        """The Batch for these sample indices: augmented as in `epoch`, or showing the given fixed `views` (one
        per sample), or not augmented at all (both None)."""
        return self[(epoch, list(indices)) if views is None else (None, list(indices), list(views))]

    def __getitem__(self, request):
        """A whole batch for an `(epoch, indices)` request (epoch None: no augmentation), or for
        `(None, indices, views)`: each sample's given fixed view."""
        epoch, indices = request[:2]
        a = self.augment
        if len(request) == 3:
            augmented, views = True, [int(v) for v in request[2]]
        else:  # with fixed views, every epoch's request names its view (the teacher's outputs are kept per view)
            fixed = epoch is not None and a.views > 0
            augmented = epoch is not None and (a.active or fixed)
            views = [transforms.view_of(epoch, a.views) if fixed else -1 for _ in indices]
        idx = torch.as_tensor(indices, dtype=torch.long)
        if not augmented:
            x = self.storage.fitted(indices).float().div_(255.0)
            return self._finish(x, idx, views, self.labels[idx], torch.ones(len(idx)))
        keys = [a.key(epoch, i, v) for i, v in zip(indices, views)]
        x = self._crop_flip(indices, keys).float().div_(255.0)
        partner_y, own = self.labels[idx], torch.ones(len(idx))
        if a.mix != "none":
            _, h, w = self.image_shape
            plans = [transforms.mix_plan(k, a.mix, a.mix_alpha, len(self), h, w) for k in keys]
            partners = self._crop_flip([p.partner for p in plans], [p.partner_key for p in plans]).float().div_(255.0)
            x, own = transforms.apply_mix(x, partners, plans, a.mix)
            partner_y = self.labels[torch.tensor([p.partner for p in plans], dtype=torch.long)]
        return self._finish(x, idx, views, partner_y, own)

    def _crop_flip(self, indices, keys):
        a = self.augment
        if a.kind == "random_resized_crop":
            return torch.stack([transforms.random_resized_crop_flip(self.storage.source(i), key, self.image_shape[-1],
                                                                    a.scale, a.flip) for i, key in zip(indices, keys)])
        images = self.storage.fitted(indices)
        padding = a.padding if a.kind == "pad_crop" else 0
        if padding == 0 and not a.flip:
            return images
        return transforms.pad_crop_flip(images, keys, padding, a.flip)

    def _finish(self, x, idx, views, partner_y, own):
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return Batch(x, self.labels[idx], idx, torch.tensor(views, dtype=torch.long), partner_y,
                     own.to(torch.float32))

    def fingerprint(self):
        """What determines the pixels a model is given (the images, their shape and resize rule, the
        normalisation), as 16 hex digits: the data part of the teacher-output store's key."""
        what = {"shape": self.image_shape, "rule": self.rule,
                "mean": None if self.mean is None else self.mean.flatten().tolist(),
                "std": None if self.std is None else self.std.flatten().tolist()}
        if self.rule and self.rule["shorter_side"] != self.rule["height"]:
            what["zoom"] = "every image"  # since images already at the model's size are zoomed too (eval_crop < 1)
        held = [p.held_rule for p in getattr(self.storage, "parts", [self.storage]) if getattr(p, "keep_original", 0)]
        if held:  # random crops are cut from images kept at this size, not from the files' own
            what["held"] = held[0]
        h = hashlib.sha256(json.dumps(what, sort_keys=True).encode())
        self.storage.fingerprint(h)
        return h.hexdigest()[:16]

    def raw(self, indices):
        """uint8 images at the model's size (the deterministic eval rule) and int64 labels."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return self.storage.fitted(idx.tolist()), self.labels[idx]


def _to_tensor(pil, channels):
    import numpy as np

    a = np.asarray(pil, dtype=np.uint8)
    a = a[..., None] if a.ndim == 2 else a
    return torch.from_numpy(a.copy()).permute(2, 0, 1).contiguous()[:channels]
