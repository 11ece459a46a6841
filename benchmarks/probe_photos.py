"""The probe that chose the photos recipe's resolution and optimizer: a plain training loop (not the product) on
an image folder - images decoded once at shorter side image_size / 0.875, random-resized crops (area --scale..1)
and flips, bf16 autocast, channels-last - for a model trained alone, or a student distilled from a saved teacher
(standardized KD on the very crops the student sees, the teacher run on every batch). One JSON line per epoch.

    THREADS=2 python benchmarks/probe_photos.py --root ../shared/data/imagenette-dev --model torchvision:resnet18 \\
        --size 64 --epochs 20 --opt adamw --lr 0.003 --wd 0.05 --bs 64                    # ~12 min
    THREADS=2 python benchmarks/probe_photos.py ... --size 112 --epochs 16 --opt sgd --lr 0.2 --bs 128
    ... --model resnet18_half --teacher torchvision:resnet18=/tmp/teacher.pt                # distilled

The 1-D parameters (norm scales and shifts, biases) are not decayed, as the recipe's norm_weight_decay: 0.
Results: BENCHMARKS.md, "Real photos at their own resolution".
"""

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2 as T
from PIL import Image

from compress.models.registry import build_model

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def decode(root, split, classes, short):
    images, labels = [], []
    for index, name in enumerate(classes):
        folder = os.path.join(root, split, name)
        for file in sorted(os.listdir(folder)):
            im = Image.open(os.path.join(folder, file)).convert("RGB")
            scale = short / min(im.size)
            im = im.resize((max(short, round(im.width * scale)), max(short, round(im.height * scale))), Image.BILINEAR)
            images.append(torch.from_numpy(np.array(im)).permute(2, 0, 1))
            labels.append(index)
    return images, torch.tensor(labels)


def normalise(x):
    return ((x.float().div(255) - MEAN) / STD).contiguous(memory_format=torch.channels_last)


def standardized_kd(student, teacher, temperature):
    z = [(v - v.mean(1, keepdim=True)) / (v.std(1, keepdim=True) + 1e-7) for v in (student, teacher)]
    return F.kl_div(F.log_softmax(z[0] / temperature, 1), F.softmax(z[1] / temperature, 1),
                    reduction="batchmean") * temperature ** 2


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="../shared/data/imagenette-dev")
    p.add_argument("--cache", default="/tmp", help="folder for the decoded images (reused by later probes)")
    p.add_argument("--model", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--opt", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--ls", type=float, default=0.1, help="label smoothing (alone)")
    p.add_argument("--scale", type=float, default=0.35)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--teacher", help="MODEL=FILE: distil from this saved teacher")
    p.add_argument("--T", type=float, default=1.0)
    p.add_argument("--kd-weight", type=float, default=9.0)
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--save", help="write the trained weights here (torch.save of a state dict)")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    torch.manual_seed(a.seed)
    classes = sorted(os.listdir(os.path.join(a.root, "train")))
    short = int(round(a.size / 0.875))
    cache = os.path.join(a.cache, f"probe_photos_pixels_{short}.pt")
    if os.path.exists(cache):
        data = torch.load(cache, weights_only=True)
    else:
        data = {split: decode(a.root, split, classes, short) for split in ("train", "val")}
        torch.save(data, cache)
    (train_x, train_y), (val_x, val_y) = data["train"], data["val"]
    val = normalise(torch.stack([T.functional.center_crop(x, [a.size, a.size]) for x in val_x]))
    crop = T.RandomResizedCrop(a.size, scale=(a.scale, 1.0), antialias=True)

    def batch(indices):
        x = torch.stack([(lambda c: c.flip(-1) if torch.rand(1).item() < 0.5 else c)(crop(train_x[i]))
                         for i in indices])
        return normalise(x), train_y[indices]

    model = build_model(a.model, (3, a.size, a.size), len(classes)).to(memory_format=torch.channels_last)
    teacher = None
    if a.teacher:
        name, path = a.teacher.split("=")
        teacher = build_model(name, (3, a.size, a.size), len(classes)).to(memory_format=torch.channels_last)
        teacher.load_state_dict(torch.load(path, weights_only=True))
        teacher.eval()
    groups = [{"params": [q for q in model.parameters() if q.ndim <= 1], "weight_decay": 0.0},
              {"params": [q for q in model.parameters() if q.ndim > 1]}]
    optimizer = (torch.optim.SGD(groups, lr=a.lr, momentum=0.9, nesterov=True, weight_decay=a.wd) if a.opt == "sgd"
                 else torch.optim.AdamW(groups, lr=a.lr, weight_decay=a.wd))
    steps = len(train_y) // a.bs
    total, warm = steps * a.epochs, steps  # one epoch of linear warm-up, then cosine to 0

    def lr_at(s):
        return a.lr * (s + 1) / warm if s < warm else a.lr * 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm)))

    def evaluate(m):
        m.eval()
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            right = sum((m(val[i:i + 250]).argmax(1) == val_y[i:i + 250]).sum().item() for i in range(0, len(val), 250))
        m.train()
        return 100.0 * right / len(val)

    g, step, start = torch.Generator().manual_seed(a.seed), 0, time.time()
    for epoch in range(a.epochs):
        order, began, running = torch.randperm(len(train_y), generator=g), time.time(), 0.0
        for b in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            x, y = batch(order[b * a.bs:(b + 1) * a.bs].tolist())
            with torch.autocast("cpu", torch.bfloat16):
                out = model(x)
                if teacher is None:
                    loss = F.cross_entropy(out.float(), y, label_smoothing=a.ls)
                else:
                    with torch.no_grad():
                        target = teacher(x)
                    loss = a.ce_weight * F.cross_entropy(out.float(), y) + a.kd_weight * standardized_kd(
                        out.float(), target.float(), a.T)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step, running = step + 1, running + loss.item()
        print(json.dumps({"epoch": epoch + 1, "loss": round(running / steps, 4), "val": round(evaluate(model), 2),
                          "epoch_s": round(time.time() - began, 1), "total_min": round((time.time() - start) / 60, 2)}),
              flush=True)
    if a.save:
        torch.save(model.state_dict(), a.save)


if __name__ == "__main__":
    main()
