"""Seeded training augmentation, reproducible anywhere: every random choice for sample `i` comes from a
generator seeded by (seed, epoch, i) - or, with a fixed set of K views per image, by (seed, view, i) - so a
resumed run, another DDP rank, or a DataLoader worker process draws exactly the same crop and flip.

    pad_crop              zero-pad by `padding` pixels, crop back to the image size at a random offset
                          (the classic CIFAR augmentation; batched in one indexing operation)
    random_resized_crop   a random area (`scale`) and aspect ratio (3/4..4/3), resized to the output size
                          (torchvision's RandomResizedCrop algorithm, via transforms.v2.functional)
    flip                  horizontal, with probability 1/2 (both modes)
"""

import hashlib
import math
import random

import torch
import torch.nn.functional as F


def sample_rng(*key):
    """A random.Random seeded from the key's text: the same numbers on every machine and process."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def view_of(seed, epoch, index, views):
    """Which of the sample's `views` fixed augmented views it shows in `epoch`."""
    return sample_rng(seed, "view", epoch, index).randrange(views)


def augmentation_key(seed, epoch, index, view):
    """What seeds sample `index`'s augmentation: its view when views are fixed, else the epoch."""
    return (seed, "view", view, index) if view >= 0 else (seed, "epoch", epoch, index)


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
