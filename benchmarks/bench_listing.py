"""What listing a large image folder costs a run that has nothing to do: a finished run directory of all four
stages on a synthetic tree of --files images in 10 class folders, then `compress run` again (every stage
decides it is up to date, and the report is rewritten) by each --variant of the code, on its own copy of the run
directory, interleaved, --rounds rounds. The images are hard links to one 8x8 PNG, so the tree costs inodes, not
disk: the listing reads names and sizes, never pixels. The run trains on a sample (data.limit) for a few steps:
what is measured is listing and deciding, not training.

    git archive a8af4ca | tar -x -C /tmp/old_listing
    python benchmarks/bench_listing.py --files 200000 --variant before=/tmp/old_listing --variant after=. \\
        --work /tmp/listing --json benchmarks/results/listing.json
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
from PIL import Image


def make_tree(root, files):
    """root/<class>/<n>.png, `files` in all over 10 classes; reused when it is already there."""
    marker = os.path.join(root, f".made-{files}")
    if os.path.exists(marker):
        return
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    pixels = np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    for c in range(10):
        folder = os.path.join(root, f"class{c}")
        os.makedirs(folder)
        for i in range(c, files, 10):
            if i // 10 % 50000 == 0:  # a file system allows 65,000 links to one file
                source = os.path.join(root, f".source{c}-{i}.png")
                Image.fromarray(pixels).save(source)
            os.link(source, os.path.join(folder, f"{i}.png"))
    open(marker, "w").close()


SETTINGS = ["data.name=imagefolder", "data.image_size=8", "data.limit=200", "data.val_fraction=0.005",
            "model.teacher=compact_cnn", "model.student=compact_cnn", "teacher.epochs=1", "distill.epochs=1",
            "distill.baseline=false", "qat.epochs=1", "train.progress=false"]


def compress(code, args, run_dir, *extra):
    """Wall seconds of one `compress run` by the code at `code` (its stderr when it fails)."""
    sets = [a for s in SETTINGS + [f"data.root={args.tree}"] for a in ("--set", s)]
    cmd = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); from compress.cli import main; "
           "main(sys.argv[1:])", os.path.abspath(code), "run", "--run-dir", run_dir, *sets, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{code}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return seconds, done.stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=200000)
    parser.add_argument("--variant", action="append", required=True, help="NAME=PATH of a copy of the code")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default="/tmp/listing")
    parser.add_argument("--prepare", default=".", help="the code that writes the finished run (default: this one)")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.tree = os.path.join(args.work, f"tree{args.files}")
    variants = dict(v.split("=", 1) for v in args.variant)
    make_tree(args.tree, args.files)
    finished = os.path.join(args.work, f"finished{args.files}")
    if not os.path.exists(os.path.join(finished, "report.md")):
        shutil.rmtree(finished, ignore_errors=True)
        seconds, _ = compress(args.prepare, args, finished)
        print(f"the finished run: {seconds:.0f} s", flush=True)
    times = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            run = os.path.join(args.work, f"run-{name}")
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(finished, run)
            seconds, said = compress(variants[name], args, run)
            if said.count("up to date, skipped") != 4:
                raise SystemExit(f"{name}: not every stage was skipped:\n{said[-2000:]}")
            times[name].append(seconds)
            print(f"round {r + 1}: {name} {seconds:.1f} s", flush=True)
    result = {"files": args.files, "rounds": args.rounds,
              "seconds": {name: {"each": t, "median": statistics.median(t)} for name, t in times.items()}}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
