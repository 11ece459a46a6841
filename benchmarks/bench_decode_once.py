"""Decoding images once against decoding every batch: the photos recipe's teacher stage on real photos, the code
before the pixel cache (a git commit, run from a worktree) beside the current code, interleaved over rounds
(round r trains with seed r, so the accuracies also compare across seeds). Same config, same data, same threads.

    git worktree add /tmp/before 8af1c50      # the last commit that decoded every batch
    python benchmarks/bench_decode_once.py --root ../shared/data/imagenette-dev --before /tmp/before \\
        --work /tmp/decode --epochs 2 --rounds 3 --out benchmarks/results/decode_once.json      # ~30 min

Both versions read the photos recipe without its `*.norm_weight_decay` keys (the earlier code does not know them),
so both decay every parameter alike. Variants: `before, every batch` (the worktree's code, train.num_workers 2,
data.cache_mb 0: every batch decodes its JPEGs in two worker processes, what the earlier code did when the photos
exceeded data.cache_mb, as a new user's 9.5k photos at 160 px did), `before, held in memory` (the same with the
recipe's data.cache_mb 1024, which these 4,738 photos fit decoded at full size), `after` (this code,
train.num_workers 2), `after, in process` (this code, train.num_workers 0) and `after, memory-mapped` (this code,
data.cache_mb 256: the training pixels, 680 MB, are read from the cache's files through the page cache, as a larger
photo set's are). Each run is a fresh run directory:
`after` decodes into its own cache in its first stage (the time is in its figures); the cache's size on disk and in
memory is read from the run's log and cache folder.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (code, train.num_workers, data.cache_mb or None for the recipe's)
VARIANTS = {"before, every batch": ("before", 2, 0), "before, held in memory": ("before", 2, None),
            "after": ("after", 2, None), "after, in process": ("after", 0, None),
            "after, memory-mapped": ("after", 2, 256)}  # the training pixels (680 MB) over data.cache_mb


def slug(variant):
    return variant.replace(", ", "-").replace(" ", "-")


def run(args, variant, seed, run_dir):
    code, workers, cache_mb = VARIANTS[variant]
    env = dict(os.environ)
    if code == "before":  # the worktree's packages first on the path: its compress and stages are imported
        env["PYTHONPATH"] = args.before + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "compress", "run", "-c", args.config,
           "--run-dir", run_dir, "--stages", "teacher", "--set", f"data.root={args.root}",
           "--set", f"teacher.epochs={args.epochs}", "--set", f"seed={seed}", "--set", f"train.num_workers={workers}",
           "--set", "model.student=torchvision:mobilenet_v2",  # a name both versions know (the stage does not read it)
           "--set", "train.progress=false", "--set", f"train.threads={args.threads}"]
    cmd += ["--set", f"data.cache_mb={cache_mb}"] if cache_mb is not None else []
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=args.work)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\nfailed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "teacher", "metrics.json")) as f:
        epochs = json.load(f)["epochs"]
    held = re.findall(r"data: ([\d,]+) (train|val) images (?:at|whole up to) shorter side (\d+), ([\d,]+) MB "
                      r"(in memory|memory-mapped)",
                      proc.stderr)
    cache = os.path.join(run_dir, "cache", "pixels")
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs) if os.path.isdir(
        cache) else 0
    return {"variant": variant, "seed": seed, "wall_s": round(wall, 1), "val_acc": epochs[-1]["val_acc"],
            "images_per_s": round(statistics.mean(e["images_per_s"] for e in epochs), 1),
            "images_per_s_by_epoch": [e["images_per_s"] for e in epochs],
            "held": [{"images": h[0], "role": h[1], "side": int(h[2]), "mb": int(h[3].replace(",", "")),
                      "where": h[4]} for h in held], "cache_disk_mb": round(disk / 2**20, 1)}


def common_config(work):
    """The photos recipe as both versions read it: without the keys the earlier code does not know
    (`*.norm_weight_decay`; left out, the current code decays norm layers like the rest, as the earlier did)."""
    import yaml

    with open(os.path.join(ROOT, "configs", "photos.yaml")) as f:
        cfg = yaml.safe_load(f)
    for section in ("teacher", "distill", "qat"):
        (cfg.get(section) or {}).pop("norm_weight_decay", None)
    path = os.path.join(work, "photos-common.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path


def summary(rows):
    print("| variant | teacher-stage images/s (mean of rounds) | per round | val acc (mean ± std over seeds) | "
          "cache in memory | cache on disk |\n|---|---:|---|---:|---:|---:|")
    for variant in VARIANTS:
        rs = [r for r in rows if r["variant"] == variant]
        if not rs:
            continue
        accs = [r["val_acc"] for r in rs]
        acc = f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}" if len(accs) > 1 else f"{accs[0]:.2f}"
        memory = sum(h["mb"] for h in rs[0]["held"] if h["where"] == "in memory")
        in_memory = f"{memory} MB" if rs[0]["held"] else "-"
        on_disk = f"{rs[0]['cache_disk_mb']} MB" if rs[0]["cache_disk_mb"] else "-"
        print(f"| {variant} | {statistics.mean(r['images_per_s'] for r in rs):.1f} | "
              f"{', '.join(str(r['images_per_s']) for r in rs)} | {acc} | {in_memory} | {on_disk} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="../shared/data/imagenette-dev")
    p.add_argument("--before", required=False, help="a worktree of the code before the pixel cache")
    p.add_argument("--work", default="/tmp/decode")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/decode_once.json")
    p.add_argument("--variants", default=",".join(map(slug, VARIANTS)),
                   help="comma-separated subset of: " + ", ".join(map(slug, VARIANTS)))
    p.add_argument("--summary", action="store_true")
    args = p.parse_args()
    if args.summary:
        with open(args.out) as f:
            summary(json.load(f)["runs"])
        return
    args.root, args.work = os.path.abspath(args.root), os.path.abspath(args.work)
    args.before = os.path.abspath(args.before) if args.before else None
    wanted = {v.strip() for v in args.variants.split(",")}
    unknown = wanted - set(map(slug, VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(map(slug, VARIANTS))}")
    chosen = [v for v in VARIANTS if slug(v) in wanted]
    if not args.before and any(VARIANTS[v][0] == "before" for v in chosen):
        p.error("--before: the variants named 'before' run the code of a worktree; give its folder")
    os.makedirs(args.work, exist_ok=True)
    args.config = common_config(args.work)
    rows = []
    for r in range(args.rounds):
        order = chosen if r % 2 == 0 else chosen[::-1]
        for variant in order:
            rows.append(run(args, variant, r, os.path.join(args.work, f"{slug(variant)}-{r}")))
            print(json.dumps(rows[-1]), flush=True)
            with open(args.out, "w") as f:
                json.dump({"command": " ".join(sys.argv), "runs": rows}, f, indent=1)
    summary(rows)


if __name__ == "__main__":
    main()
