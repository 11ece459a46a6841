"""Distillation methods side by side, and what the teacher cache buys.

Part 1 (methods): for each seed, train the teacher once, then the student with CE alone, CE+KD, CE+cosine,
CE+hint and all three, same data, seed and epochs. Prints accuracy mean +- std over the seeds and images/s.
Part 2 (speed): distill with the cached teacher vs the textbook loop (teacher forward on every batch), same
models, batch and threads, augmentation off and on.

    python benchmarks/bench_distill.py                      # mnist5k, seeds 0,1,2, the default config
    python benchmarks/bench_distill.py --config configs/cifar10-tutorial.yaml --set data.root=~/data/cifar10
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compress.cli import setup_logging  # noqa: E402
from compress.config import load_config  # noqa: E402
from compress.pipeline import run_pipeline  # noqa: E402
from compress.rundir import RunDir  # noqa: E402

METHODS = {
    "student alone (CE)": ["distill.kd.weight=0", "distill.cosine.weight=0", "distill.hint.weight=0",
                           "distill.ce_weight=1.0"],
    "CE + KD": ["distill.kd.weight=0.25", "distill.cosine.weight=0", "distill.hint.weight=0"],
    "CE + cosine": ["distill.kd.weight=0", "distill.cosine.weight=0.25", "distill.hint.weight=0"],
    "CE + hint": ["distill.kd.weight=0", "distill.cosine.weight=0", "distill.hint.weight=0.25"],
    "CE + KD + cosine + hint": ["distill.kd.weight=0.25", "distill.cosine.weight=0.25", "distill.hint.weight=0.25"],
}


def stage_metrics(run_dir, stage):
    return RunDir(run_dir).manifest()["stages"][stage]["metrics"]


def run(config, overrides, run_dir, stages, force=False):
    cfg = load_config(config, overrides)
    start = time.perf_counter()
    run_pipeline(cfg, run_dir, stages, force=force)
    return time.perf_counter() - start


def methods_table(args, workdir):
    rows = {name: [] for name in METHODS}
    speed = {name: [] for name in METHODS}
    teachers = []
    for seed in args.seeds:
        run_dir = os.path.join(workdir, f"seed{seed}")
        base = [f"seed={seed}", *args.set]
        run(args.config, base, run_dir, ["teacher"])
        teachers.append(stage_metrics(run_dir, "teacher")["val_acc"])
        for name, extra in METHODS.items():
            run(args.config, base + extra, run_dir, ["distill"], force=True)
            m = stage_metrics(run_dir, "distill")
            rows[name].append(m["val_acc"])
            speed[name].append(m["images_per_s"])
    return teachers, rows, speed


def speed_table(args, workdir):
    """Cached teacher vs textbook loop, augmentation off and on; the stage's own images/s (last epoch) and
    the whole stage's wall time (cache build included)."""
    run_dir = os.path.join(workdir, "speed")
    base = [f"seed={args.seeds[0]}", *args.set, "distill.kd.weight=0.25", "distill.hint.weight=0.25"]
    run(args.config, base, run_dir, ["teacher"])
    out = []
    for augment in ("false", "true"):
        cells = {}
        for cache in ("true", "false"):
            seconds = run(args.config, base + [f"data.augment={augment}", f"distill.cache_teacher={cache}"],
                          run_dir, ["distill"], force=True)
            m = stage_metrics(run_dir, "distill")
            cells[cache] = {"images_per_s": m["images_per_s"], "stage_seconds": round(seconds, 1),
                            "cache_used": m["teacher_cache"]["used"], "cache_seconds": m["teacher_cache"]["seconds"],
                            "val_acc": m["val_acc"]}
        out.append((augment, cells))
    return out


def mean_std(values):
    return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (default: the built-in default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--skip-methods", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    setup_logging()
    results = {"command": " ".join(sys.argv), "threads": os.cpu_count()}
    with tempfile.TemporaryDirectory() as workdir:
        if not args.skip_methods:
            teachers, rows, speed = methods_table(args, workdir)
            results["teacher_acc"] = teachers
            results["methods"] = {k: {"acc": v, "images_per_s": speed[k]} for k, v in rows.items()}
            m, s = mean_std(teachers)
            print(f"\n| model | val acc (mean ± std, {len(args.seeds)} seeds) | images/s |")
            print("|---|---:|---:|")
            print(f"| teacher | {m:.2f} ± {s:.2f} | - |")
            for name, accs in rows.items():
                m, s = mean_std(accs)
                print(f"| {name} | {m:.2f} ± {s:.2f} | {statistics.mean(speed[name]):.0f} |")
        if not args.skip_speed:
            results["speed"] = speed_table(args, workdir)
            print("\n| augmentation | teacher | images/s (last epoch) | distill stage wall time | val acc |")
            print("|---|---|---:|---:|---:|")
            for augment, cells in results["speed"]:
                for cache, c in cells.items():
                    label = "cached" if c["cache_used"] else "every batch (textbook)"
                    extra = f" (cache built in {c['cache_seconds']:.1f}s)" if c["cache_used"] else ""
                    print(f"| {'on' if augment == 'true' else 'off'} | {label} | {c['images_per_s']:.0f} | "
                          f"{c['stage_seconds']:.1f}s{extra} | {c['val_acc']:.2f} |")
                ratio = cells["true"]["images_per_s"] / cells["false"]["images_per_s"]
                print(f"| {'on' if augment == 'true' else 'off'} | speed-up (images/s) | {ratio:.2f}x | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
