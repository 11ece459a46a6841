"""fp32 against train.precision: auto (bf16 autocast on a CPU that computes bf16 natively), through the product:

  speed     the teacher and the distill stage in each precision, interleaved, --rounds rounds: each stage's
            training images/s (the mean over its epochs, from metrics.json, so the store's one-time build does not
            count), and the stage's wall time;
  accuracy  over --seeds: the teacher (--teacher-epochs) and the distilled student (the recipe's distill stage,
            --distill-epochs) in each precision, and the int8 ONNX of the first seed's student.

Each precision has its own run directory (the teacher-output store is computed under the training precision,
so the two do not share one).

    python benchmarks/bench_precision.py --config configs/cifar10.yaml --set data.root=../shared/data/cifar10-dev \
        --work /tmp/precision --json benchmarks/results/precision.json
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

PRECISIONS = ("fp32", "auto")


def compress(args, run_dir, stages, overrides):
    cmd = [os.path.join(os.path.dirname(sys.executable), "compress"), "run", "--run-dir", run_dir, "--stages",
           stages, "--set", "train.progress=false"]
    cmd += (["-c", args.config] if args.config else []) + [a for o in [*args.set, *overrides] for a in ("--set", o)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\nfailed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "manifest.json")) as f:
        return json.load(f)["stages"], round(time.perf_counter() - start, 1)


def epoch_rate(run_dir, stage):
    with open(os.path.join(run_dir, stage, "metrics.json")) as f:
        return statistics.mean(e["images_per_s"] for e in json.load(f)["epochs"])


def speed(args):
    out = {p: {"teacher": [], "distill": []} for p in PRECISIONS}
    for r in range(args.rounds):
        for p in (PRECISIONS if r % 2 == 0 else PRECISIONS[::-1]):
            run = os.path.join(args.work, f"speed-{p}-{r}")
            shutil.rmtree(run, ignore_errors=True)
            common = [f"train.precision={p}", f"teacher.epochs={args.speed_epochs}",
                      f"distill.epochs={args.speed_epochs}", "distill.baseline=false"]
            manifest, _ = compress(args, run, "teacher,distill", common)
            for stage in ("teacher", "distill"):
                out[p][stage].append(round(epoch_rate(run, stage), 1))
            print(f"round {r + 1} {p}: teacher {out[p]['teacher'][-1]} images/s, distill {out[p]['distill'][-1]} "
                  f"images/s ({manifest['distill']['metrics']['precision']})", flush=True)
    return out


def accuracy(args):
    out = {p: {"teacher": [], "student": []} for p in PRECISIONS}
    for p in PRECISIONS:
        for seed in args.seeds:
            run = os.path.join(args.work, f"acc-{p}-s{seed}")
            overrides = [f"train.precision={p}", f"seed={seed}", f"teacher.epochs={args.teacher_epochs}",
                         f"distill.epochs={args.distill_epochs}", "distill.baseline=false"]
            manifest, wall = compress(args, run, "teacher,distill", overrides)
            out[p]["teacher"].append(manifest["teacher"]["metrics"]["val_acc"])
            out[p]["student"].append(manifest["distill"]["metrics"]["val_acc"])
            print(f"{p} seed {seed}: teacher {out[p]['teacher'][-1]:.2f}%, student {out[p]['student'][-1]:.2f}% "
                  f"({wall} s)", flush=True)
            if seed == args.seeds[0]:
                manifest, _ = compress(args, run, "qat,export", overrides)
                out[p]["int8_onnx"] = manifest["export"]["metrics"]["int8_onnx_acc"]
                out[p]["fp32_onnx"] = manifest["export"]["metrics"]["fp32_onnx_acc"]
    return out


def mean_std(v):
    return statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--speed-epochs", type=int, default=3)
    p.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--teacher-epochs", type=int, default=30)
    p.add_argument("--distill-epochs", type=int, default=40)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    out = {"command": "python benchmarks/bench_precision.py " + " ".join(sys.argv[1:])}
    if not args.skip_speed:
        out["speed"] = speed(args)
        print("\n| stage | fp32 images/s (rounds) | auto images/s (rounds) | auto / fp32 |\n|---|---:|---:|---:|")
        for stage in ("teacher", "distill"):
            a, b = out["speed"]["fp32"][stage], out["speed"]["auto"][stage]
            print(f"| {stage} | {statistics.median(a):.0f} ({a}) | {statistics.median(b):.0f} ({b}) | "
                  f"{statistics.median(b) / statistics.median(a):.2f}x |")
    if not args.skip_accuracy:
        out["accuracy"] = acc = accuracy(args)
        print("\n| model | fp32 (mean ± std) | auto (mean ± std) |\n|---|---:|---:|")
        for key in ("teacher", "student"):
            (m1, s1), (m2, s2) = mean_std(acc["fp32"][key]), mean_std(acc["auto"][key])
            print(f"| {key} | {m1:.2f} ± {s1:.2f} | {m2:.2f} ± {s2:.2f} |")
        print(f"| int8 ONNX (seed {args.seeds[0]}) | {acc['fp32']['int8_onnx']:.2f} | {acc['auto']['int8_onnx']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
