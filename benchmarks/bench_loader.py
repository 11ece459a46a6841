"""Is the data loader the bottleneck? Images/s of the training loader alone (decode, seeded augmentation,
normalisation, with train.num_workers worker processes) against the training step's images/s that a finished
run recorded in its metrics.

    python benchmarks/bench_loader.py RUN_DIR [--workers 0,2] [--batches 60]
    python benchmarks/bench_loader.py --config photos --set data.root=../shared/data/imagenette-dev --workers 0,1,2

The loader is read exactly as the teacher stage reads it (compress.data.sampling.train_loader over the training
split with teacher.mix), one process, the run's own config.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compress.data.datasets import load_data  # noqa: E402
from compress.data.sampling import train_loader  # noqa: E402
from compress.run.config import load_config  # noqa: E402
from compress.run.recipes import resolve  # noqa: E402


def loader_rate(train_set, batch, seed, workers, batches):
    loader = train_loader(train_set, batch, 0, 1, seed, num_workers=workers)
    loader.sampler.set_epoch(1)
    it = iter(loader)
    next(it)  # workers started, first batch out
    images, start = 0, time.perf_counter()
    for i, b in enumerate(it):
        images += len(b.y)
        if i + 1 >= batches:
            break
    return images / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="?", help="a finished run directory (its config, and its training speed)")
    parser.add_argument("--config", help="a config file or shipped recipe instead of a run directory")
    parser.add_argument("--set", action="append", default=[], help="overrides, with --config")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the worker counts, interleaved")
    args = parser.parse_args()
    if bool(args.run) == bool(args.config):
        parser.error("give a run directory or --config, not both")
    steps = {}
    if args.config:
        cfg = load_config(resolve(args.config)[0], args.set)
    else:
        cfg = load_config(os.path.join(args.run, "config.yaml"))
        stages = json.load(open(os.path.join(args.run, "manifest.json")))["stages"]
        steps = {s: stages[s]["metrics"].get("images_per_s") for s in ("teacher", "distill", "qat") if s in stages}
        print("training step (from the run's metrics, last epoch): " + ", ".join(f"{s} {v:.0f} images/s"
                                                                                 for s, v in steps.items() if v))
    data = load_data(cfg.data, cfg.seed)
    train_set = data.train.with_augment(mix=cfg.teacher.mix, mix_alpha=cfg.teacher.mix_alpha)
    for _ in range(args.repeats):
        for workers in (int(w) for w in args.workers.split(",")):
            rate = loader_rate(train_set, cfg.teacher.batch_size, cfg.seed, workers, args.batches)
            ratios = ", ".join(f"{rate / v:.1f}x {s}" for s, v in steps.items() if v)
            print(f"loader alone, {workers} worker(s): {rate:.0f} images/s" + (f" ({ratios})" if ratios else ""),
                  flush=True)


if __name__ == "__main__":
    main()
