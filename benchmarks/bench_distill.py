"""Distillation speed through the product, on a real recipe with augmentation on (one view per epoch):

  reuse    the distill stage in a fresh run directory (it builds the teacher-output store: every view of every
           image through the teacher once), then again with other loss weights (the store reused: the teacher runs
           zero times), against the textbook KD loop that runs the frozen teacher on every batch - same models,
           augmentation, precision, memory layout, batch and epochs; images/s over the whole stage (the store's
           build included in the first run), interleaved rounds;
  methods  the distill stage with each logit loss (hinton, dkd, dist, standardized) from the one store: training
           images/s (the mean over epochs, from metrics.json) of each, divided by Hinton KD's.

The teacher comes from --teacher (a run directory holding a trained teacher stage) or is trained first for
--teacher-epochs (its accuracy does not matter for speed).

    python benchmarks/bench_distill.py --config configs/cifar10.yaml --set data.root=../shared/data/cifar10-dev \
        --teacher /tmp/kdtable/run --epochs 10 --work /tmp/bench-distill --json benchmarks/results/distill_speed.json
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

from compress.data.datasets import load_data
from compress.data.sampling import train_loader
from compress.distill.logit_losses import standardized
from compress.models.registry import build_model
from compress.run.config import load_config
from compress.training.checkpoint import load_weights
from compress.training.losses import label_loss
from compress.training.precision import Precision

METHODS = {"hinton": ["distill.kd.method=hinton", "distill.ce_weight=0.1", "distill.kd.weight=0.9"],
           "dkd": ["distill.kd.method=dkd", "distill.ce_weight=1.0", "distill.kd.weight=1.0"],
           "dist": ["distill.kd.method=dist", "distill.ce_weight=1.0", "distill.kd.weight=1.0"],
           "standardized": ["distill.kd.method=standardized", "distill.ce_weight=0.1", "distill.kd.weight=9.0"]}


def compress(args, run_dir, stages, overrides, extra=()):
    """`compress run` of the installed package (`extra`: more command-line options, e.g. --nproc-per-node);
    returns the manifest's stages."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "compress"), "run", "--run-dir", run_dir, "--stages",
           stages, "--set", "train.progress=false", *extra]
    cmd += (["-c", args.config] if args.config else []) + [a for o in [*args.set, *overrides] for a in ("--set", o)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\nfailed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "manifest.json")) as f:
        return json.load(f)["stages"]


def copy_teacher(src, dst):
    """A run directory holding only the trained teacher (its folder and manifest entry)."""
    os.makedirs(dst)
    shutil.copytree(os.path.join(src, "teacher"), os.path.join(dst, "teacher"))
    with open(os.path.join(src, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["stages"] = {"teacher": manifest["stages"]["teacher"]}
    with open(os.path.join(dst, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def epoch_rate(run_dir):
    with open(os.path.join(run_dir, "distill", "metrics.json")) as f:
        return statistics.mean(e["images_per_s"] for e in json.load(f)["epochs"])


def textbook(cfg, teacher_file, epochs):
    """The textbook KD loop: the frozen teacher on every augmented batch, the student trained on the same
    pixels, standardized KD + CE - in the stage's precision and memory layout, fresh augmentation each epoch."""
    data = load_data(cfg.data, cfg.seed)
    d = cfg.distill
    teacher = build_model(cfg.model.teacher, data.input_shape, data.num_classes)
    load_weights(teacher, teacher_file)
    torch.manual_seed(cfg.seed)
    student = build_model(cfg.model.student, data.input_shape, data.num_classes)
    precision = Precision.for_run(cfg.train.precision, torch.device("cpu")).place([teacher, student],
                                                                                   data.train.batch([0]).x)
    teacher.eval().requires_grad_(False)
    optimizer = torch.optim.SGD(student.parameters(), lr=d.lr, momentum=d.momentum, nesterov=True,
                                weight_decay=d.weight_decay)
    loader = train_loader(data.train, d.batch_size, 0, 1, cfg.seed)
    count, start = 0, time.perf_counter()
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        student.train()
        for batch in loader:
            x = batch.x.contiguous(memory_format=precision.memory_format)
            with precision.autocast():
                with torch.no_grad():
                    t = teacher(x).float()
                s = student(x).float()
                loss = 0.1 * label_loss(s, batch) + 9.0 * standardized(s, t, 2.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            count += len(batch.y)
    return count / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--teacher", help="a run directory with a trained teacher stage")
    p.add_argument("--teacher-epochs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", required=True)
    p.add_argument("--json")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    teacher_run = args.teacher
    if not teacher_run:
        teacher_run = os.path.join(args.work, "teacher")
        compress(args, teacher_run, "teacher", [f"teacher.epochs={args.teacher_epochs}"])
    cfg = load_config(args.config, [*args.set, f"distill.epochs={args.epochs}"])
    images = len(load_data(cfg.data, cfg.seed).train) * args.epochs
    base = [f"distill.epochs={args.epochs}", "distill.baseline=false", *METHODS["standardized"]]
    rows = {"first run (builds the store)": [], "second run (store reused)": [], "textbook KD loop": []}
    methods = {m: [] for m in METHODS}
    for r in range(args.rounds):
        run = os.path.join(args.work, f"round{r}")
        shutil.rmtree(run, ignore_errors=True)
        copy_teacher(teacher_run, run)
        for part in (("product", "textbook") if r % 2 == 0 else ("textbook", "product")):
            if part == "textbook":
                rate = textbook(cfg, os.path.join(teacher_run, "teacher", "model.safetensors"), args.epochs)
                rows["textbook KD loop"].append(round(rate, 1))
                print(f"round {r + 1} textbook KD loop: {rate:.0f} images/s", flush=True)
                continue
            for which, overrides, status in (("first run (builds the store)", base, "build"),
                                             ("second run (store reused)", [*base, "distill.kd.weight=8.0"], "reuse")):
                manifest = compress(args, run, "distill", overrides)
                assert manifest["distill"]["metrics"]["teacher_outputs"]["status"] == status
                rows[which].append(round(images / manifest["distill"]["seconds"], 1))
                print(f"round {r + 1} {which}: {rows[which][-1]:.0f} images/s", flush=True)
        for method in (list(METHODS) if r % 2 == 0 else list(METHODS)[::-1]):
            compress(args, run, "distill", [f"distill.epochs={args.epochs}", "distill.baseline=false",
                                            *METHODS[method]])
            methods[method].append(round(epoch_rate(run), 1))
            print(f"round {r + 1} {method}: {methods[method][-1]:.0f} images/s (training)", flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    out = {"command": "python benchmarks/bench_distill.py " + " ".join(sys.argv[1:]), "epochs": args.epochs,
           "images": images, "rounds": rows, "methods": methods}
    print(f"\n| run ({args.epochs} epochs, {images:,} images seen) | images/s (median of {args.rounds}) | "
          "÷ textbook |\n|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.0f} | {v / med['textbook KD loop']:.2f}x |")
    print(f"\nsecond run ÷ first run: {med['second run (store reused)'] / med['first run (builds the store)']:.2f}x")
    hinton = statistics.median(methods["hinton"])
    print("\n| method | training images/s | ÷ Hinton KD |\n|---|---:|---:|")
    for m, v in methods.items():
        print(f"| {m} | {statistics.median(v):.0f} | {statistics.median(v) / hinton:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
