"""The teacher-output store at ImageNet scale, with synthetic logits (1,000 classes): bytes per (image, view),
build time, lookup time per batch and memory as the number of samples grows (10 k, 100 k, 1 M), and the
projection for ImageNet-1k with 8 views on 1, 2 and 8 processes. The teacher is replaced by a function of the
sample index (so the figures are the store's own cost, not a network's); everything else is the product's code
(compress.distill.store).

    python benchmarks/bench_store.py --samples 10000,100000,1000000 --out /tmp/store-bench
"""

import argparse
import json
import os
import resource
import shutil
import time

import numpy as np
import torch

from compress.distill.store import StoreSpec, TeacherOutputStore
from compress.training.distributed import DistEnv

IMAGENET = 1_281_167


class IndexSet:
    """A dataset whose images are their sample indices: `batch(...).x` is the index column."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def batch(self, samples, views):
        x = torch.tensor(samples, dtype=torch.float32)[:, None] + 1e6 * torch.tensor(views)[:, None]
        return type("B", (), {"x": x})


def synthetic_teacher(classes):
    """Logits that depend only on the sample (and view): a seeded draw per row, peaked on one class."""
    def teacher(x):
        keys = x[:, 0].to(torch.int64)
        g = torch.Generator().manual_seed(int(keys[0]))
        logits = torch.randn(len(keys), classes, generator=g) * 2
        logits[torch.arange(len(keys)), keys % classes] += 8
        return {"logits": logits}
    return teacher


def rss_mb():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) / 1024


def measure(n, views, classes, top_k, folder, batch):
    spec = StoreSpec("0" * 64, "synthetic", f"n{n}", n, views, classes, top_k, {"kind": "synthetic"}, "fp32")
    store = TeacherOutputStore(folder, spec)
    plan = store.prepare(DistEnv())
    before = rss_mb()
    start = time.perf_counter()
    store.build(synthetic_teacher(classes), IndexSet(n), DistEnv(), 4096, lambda x: x, plan)
    build_s = time.perf_counter() - start
    build_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    reuse = store.prepare(DistEnv())  # what a second run does first: check every chunk
    verify_s = time.perf_counter() - start
    assert reuse["status"] == "reuse"
    store.open()
    rng = np.random.default_rng(0)
    lookups = []
    for _ in range(200):  # random batches, as a shuffled epoch asks for them
        idx = rng.integers(0, n, batch)
        view = np.full(batch, rng.integers(0, views))
        start = time.perf_counter()
        out = store.lookup(idx, view, "cpu")["logits"]
        lookups.append(time.perf_counter() - start)
    assert out.shape == (batch, classes)
    on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return {"samples": n, "views": views, "classes": classes, "top_k": top_k, "bytes_per_row": spec.bytes_per_row(),
            "on_disk_mb": round(on_disk / 1e6, 2), "build_s": round(build_s, 2),
            "build_rows_per_s": round(n * views / build_s), "verify_s": round(verify_s, 2),
            "lookup_ms_per_batch_median": round(1000 * float(np.median(lookups)), 3), "batch": batch,
            "rss_before_mb": round(before, 1), "rss_after_lookups_mb": round(rss_mb(), 1),
            "peak_rss_during_build_mb": round(build_peak, 1), "chunks": spec.chunks}


def projection(classes, top_k, views):
    spec = StoreSpec("0" * 64, "x", "x", IMAGENET, views, classes, top_k, {}, "bf16")
    dense_fp32 = IMAGENET * views * classes * 4
    rows = []
    for world in (1, 2, 8):
        # building: one chunk computed per process, all_gathered (padded to the chunk size) for rank 0 to write
        build = world * spec.rows_per_chunk * spec.bytes_per_row()
        rows.append({"processes": world, "store_on_disk_gb": round(spec.total_bytes() / 1e9, 3),
                     "build_memory_per_process_mb": round(build / 1e6, 1),
                     "old_cache_per_process_gb": round(dense_fp32 / 1e9, 1)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", default="10000,100000,1000000")
    p.add_argument("--views", type=int, default=1)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--out", required=True, help="a scratch folder (each store is removed after its measurement)")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results = {"command": "python benchmarks/bench_store.py " + " ".join(os.sys.argv[1:]), "measured": []}
    for n in (int(v) for v in args.samples.split(",")):
        folder = os.path.join(args.out, f"store-{n}")
        shutil.rmtree(folder, ignore_errors=True)
        row = measure(n, args.views, args.classes, args.top_k, folder, args.batch)
        results["measured"].append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    results["imagenet_8_views"] = projection(args.classes, args.top_k, 8)
    print(f"\nbytes per (image, view): top-{args.top_k} of {args.classes} in fp16 = "
          f"{results['measured'][0]['bytes_per_row']}, dense fp32 = {4 * args.classes}")
    print("| samples | on disk | build | rows/s | verify (reuse) | lookup / batch of 128 | RSS after lookups "
          "| peak RSS |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["measured"]:
        print(f"| {r['samples']:,} | {r['on_disk_mb']} MB | {r['build_s']} s | {r['build_rows_per_s']:,} | "
              f"{r['verify_s']} s | {r['lookup_ms_per_batch_median']} ms | {r['rss_after_lookups_mb']} MB | "
              f"{r['peak_rss_during_build_mb']} MB |")
    print("\nImageNet-1k, 8 views:")
    for r in results["imagenet_8_views"]:
        print(f"  {r['processes']} process(es): store {r['store_on_disk_gb']} GB on disk (shared, memory-mapped); "
              f"building holds {r['build_memory_per_process_mb']} MB per process; the old in-memory cache held "
              f"{r['old_cache_per_process_gb']} GB in every process")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
