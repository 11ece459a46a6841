"""Seeded training augmentation, reproducible anywhere: every random choice for sample `i` comes from a
generator seeded by (seed, epoch, i) - or, with a fixed set of K views per image, by (view seed, view, i) - so a
resumed run, another DDP rank, or a DataLoader worker process draws exactly the same crop, flip and mix.

    pad_crop              zero-pad by `padding` pixels, crop back to the image size at a random offset
                          (the classic CIFAR augmentation; batched in one indexing operation)
    random_resized_crop   a random area (`scale`) and aspect ratio (3/4..4/3), resized to the output size
                          (torchvision's RandomResizedCrop algorithm, via transforms.v2.functional)
    flip                  horizontal, with probability 1/2 (both modes)
    mixup                 the image blended with a partner image (drawn from the whole dataset by the same
                          generator, with its own crop and flip): lam * x + (1 - lam) * partner, lam ~ Beta(a, a)
                          (Zhang et al. 2018)
    cutmix                a box of the partner pasted in, area (1 - lam) with lam ~ U(0, 1), centre uniform and
                          clipped to the image (Yun et al. 2019); the label weight is the share left of the image
"""

import hashlib
import math
import random
from typing import NamedTuple

import torch
import torch.nn.functional as F


def sample_rng(*key):
    """A random.Random seeded from the key's text: the same numbers on every machine and process."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def view_of(epoch, views):
    """Which of its `views` fixed augmented views every sample shows in `epoch`: epoch mod views, so with as
    many views as epochs each view is shown exactly once (a fresh view every epoch), and a run of fewer epochs
    uses the first views of a larger set."""
    return epoch % views


def augmentation_key(seed, epoch, index, view):
    """What seeds sample `index`'s augmentation: its view when views are fixed (`seed` is then the view seed),
    else the epoch (`seed` is the training seed)."""
    return (seed, "view", view, index) if view >= 0 else (seed, "epoch", epoch, index)


class MixPlan(NamedTuple):
    """How one sample is mixed: with `partner` (a dataset index), whose own crop and flip are seeded by
    `partner_key`; mixup blends with weight `lam`, cutmix pastes the partner's box (rows y0:y1, columns x0:x1)."""

    partner: int
    partner_key: tuple
    lam: float
    box: tuple


def mix_plan(key, kind, alpha, size, height, width):
    """The seeded mixing of the sample whose augmentation key is `key` (`size` samples to draw partners from)."""
    r = sample_rng(*key, "mix")
    partner = r.randrange(size)
    if kind == "mixup":
        return MixPlan(partner, (*key, "partner"), r.betavariate(alpha, alpha), ())
    lam = r.random()
    cut = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * cut), int(width * cut)
    cy, cx = r.randrange(height), r.randrange(width)
    box = (min(max(cy - cut_h // 2, 0), height), min(max(cy + cut_h // 2, 0), height),
           min(max(cx - cut_w // 2, 0), width), min(max(cx + cut_w // 2, 0), width))
    return MixPlan(partner, (*key, "partner"), lam, box)


def apply_mix(x, partner, plans, kind):
    """Float images (B, C, H, W) mixed with their partners' images; returns (mixed, own share of each image):
    the weight the image's own label gets (mixup: lam; cutmix: the share of pixels not pasted over)."""
    if kind == "mixup":
        lam = torch.tensor([p.lam for p in plans], dtype=x.dtype).view(-1, 1, 1, 1)
        return lam * x + (1 - lam) * partner, lam.view(-1)
    h, w = x.shape[-2:]
    mask = torch.zeros(len(plans), 1, h, w, dtype=torch.bool)
    for i, p in enumerate(plans):
        y0, y1, x0, x1 = p.box
        mask[i, :, y0:y1, x0:x1] = True
    own = 1.0 - mask.flatten(1).float().mean(1)
    return torch.where(mask, partner, x), own


def pad_crop_flip(images, keys, padding, flip):
    """Batched: uint8 (B, C, H, W) -> the same shape, each image cropped from its zero-padded self at a seeded
    offset and maybe flipped."""
    b, c, h, w = images.shape
    draws = [sample_rng(*key) for key in keys]
    offsets = torch.tensor([[r.randint(0, 2 * padding), r.randint(0, 2 * padding)] for r in draws])
    flips = torch.tensor([flip and r.random() < 0.5 for r in draws])
    padded = F.pad(images, (padding, padding, padding, padding)) if padding else images
    rows = (offsets[:, 0:1] + torch.arange(h))[:, None, :, None]
    cols = (offsets[:, 1:2] + torch.arange(w))[:, None, None, :]
    out = padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    return torch.where(flips[:, None, None, None], out.flip(-1), out)


def random_resized_crop_flip(image, key, size, scale, flip, ratio=(3 / 4, 4 / 3)):
    """One uint8 (C, H, W) image -> (C, size, size): torchvision's RandomResizedCrop sampling, seeded."""
    import torchvision.transforms.v2.functional as TF

    r = sample_rng(*key)
    top, left, height, width = _crop_box(r, image.shape[-2], image.shape[-1], scale, ratio)
    out = TF.resized_crop(image, top, left, height, width, [size, size], antialias=True)
    if flip and r.random() < 0.5:
        out = TF.horizontal_flip(out)
    return out


def _crop_box(r, height, width, scale, ratio):
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * r.uniform(scale[0], scale[1])
        aspect = math.exp(r.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return r.randint(0, height - h), r.randint(0, width - w), h, w
    aspect = width / height  # fallback: the whole image, clamped to the allowed ratios, centred
    if aspect < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif aspect > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w
