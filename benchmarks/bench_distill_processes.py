"""The distill stage in 1 and in 2 processes (gloo, `--nproc-per-node`), from the same trained teacher, on a real
recipe: each process's peak resident memory, the teacher-output store each run builds (size on disk, and whether
the two runs' chunk files are byte-identical), training images/s, and the students' accuracy.

The store is memory-mapped: its pages are the operating system's file cache, shared by the processes of a node
and evictable, not memory a process owns; every process looks up only the rows of its own share of each batch,
and rank 0 holds at most one round of chunks (one chunk per process) while the store is built. So peak RSS per
process should not grow with the number of processes or the store's size.

    python benchmarks/bench_distill_processes.py --config configs/cifar10.yaml \
        --set data.root=../shared/data/cifar10-dev --teacher /tmp/kdtable/run --epochs 10 \
        --work /tmp/bench-processes --json benchmarks/results/distill_processes.json
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distill import METHODS, compress, copy_teacher  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--teacher", required=True, help="a run directory with a trained teacher stage")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--work", required=True)
    p.add_argument("--json")
    args = p.parse_args()
    rows = {}
    for world in (1, 2):
        run = os.path.join(args.work, f"p{world}")
        shutil.rmtree(run, ignore_errors=True)
        copy_teacher(args.teacher, run)
        start = time.perf_counter()
        stages = compress_world(args, run, world)
        wall = time.perf_counter() - start
        m = stages["distill"]["metrics"]
        with open(os.path.join(run, "distill", "teacher_outputs", "store.json")) as f:
            store = json.load(f)
        rows[world] = {"wall_s": round(wall, 1), "peak_rss_mb": m["peak_rss_mb"], "val_acc": m["val_acc"],
                       "images_per_s": round(statistics.mean(e["images_per_s"] for e in _epochs(run)), 1),
                       "store_mb": round(store["bytes"] / 1e6, 2), "store_chunks": store["chunks"],
                       "store_build_s": store["last_build"]["seconds"], "world_size": stages["distill"]["world_size"]}
        print(f"{world} process(es): peak RSS {m['peak_rss_mb']} MB, store {rows[world]['store_mb']} MB built in "
              f"{rows[world]['store_build_s']} s, {rows[world]['images_per_s']:.0f} images/s, val acc "
              f"{m['val_acc']:.2f}%", flush=True)
    same_store = rows[1]["store_chunks"] == rows[2]["store_chunks"]
    print("\n| processes | peak RSS per process (MB) | store on disk (MB) | store build (s) | training images/s | "
          "val acc |\n|---:|---|---:|---:|---:|---:|")
    for world, r in rows.items():
        print(f"| {world} | {', '.join(f'{x:.0f}' for x in r['peak_rss_mb'])} | {r['store_mb']} | "
              f"{r['store_build_s']} | {r['images_per_s']:.0f} | {r['val_acc']:.2f} |")
    print(f"\nstore chunk files byte-identical between 1 and 2 processes: {same_store} "
          f"({len(rows[1]['store_chunks'])} chunks)")
    if args.json:
        for r in rows.values():
            r["store_chunks"] = len(r["store_chunks"])
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/bench_distill_processes.py " + " ".join(sys.argv[1:]),
                       "epochs": args.epochs, "runs": rows, "store_identical": same_store}, f, indent=2)


def _epochs(run):
    with open(os.path.join(run, "distill", "metrics.json")) as f:
        return json.load(f)["epochs"]


def compress_world(args, run, world):
    """`compress run --stages distill` with --nproc-per-node `world` (the CLI re-launches itself through
    torchrun), standardized KD as the recipe has it, no baseline."""
    overrides = [f"distill.epochs={args.epochs}", "distill.baseline=false", *METHODS["standardized"]]
    return compress(args, run, "distill", overrides, ["--nproc-per-node", str(world)])


if __name__ == "__main__":
    main()
