"""DIST's KD weight, 1 against 2 (the official DIST code's CIFAR setting), through the product on
../shared/data/cifar10-dev: the recipe's teacher (configs/cifar10.yaml, shortened with --teacher-epochs) is
trained once in --work, then each cell is a `compress run --stages distill` there with distill.kd.method=dist at
one weight and one seed; the teacher-output store is built once and reused by every cell. The first cell also
trains the student alone (distill.baseline), so both rows read against it.

    python benchmarks/bench_dist_weight.py --config configs/cifar10.yaml \
        --set data.root=/work/shared/data/cifar10-dev --set train.threads=1 \
        --work /tmp/distw/run --out benchmarks/results/dist_weight.jsonl
    python benchmarks/bench_dist_weight.py --out benchmarks/results/dist_weight.jsonl --summary

benchmarks/results/dist_weight.jsonl was measured so, with `--code` naming a frozen copy of the code before the
default changed (git archive of ff9fb12), one cell at a time on a 2-core machine shared with other work.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kd_table import add_run_args, compress, done, mean_std, record, run_then_summarize  # noqa: E402

# everything but the weight is explicit (DIST's paper settings: CE 1, tau 4, beta = gamma = 1), so the table does
# not move when the registry's default does
DIST = ["distill.kd.method=dist", "distill.ce_weight=1.0", "distill.kd.temperature=4.0",
        "distill.kd.dist.beta=1.0", "distill.kd.dist.gamma=1.0"]


def run(args):
    finished = done(args.out)
    if "teacher" not in finished:
        manifest, _ = compress(args, "teacher", [f"teacher.epochs={args.teacher_epochs}"])
        t = manifest["teacher"]
        record(args.out, {"key": "teacher", "val_acc": t["metrics"]["val_acc"], "wall_s": t["seconds"],
                          "epochs": args.teacher_epochs})
    first = True
    for seed in args.seeds:
        for weight in args.weights:
            key = f"dist w{weight:g}@{args.epochs}/s{seed}"
            baseline = first
            first = False
            if key in finished:
                continue
            full = [f"seed={seed}", f"distill.epochs={args.epochs}", f"teacher.epochs={args.teacher_epochs}",
                    f"distill.baseline={'true' if baseline else 'false'}", *DIST, f"distill.kd.weight={weight}"]
            manifest, wall = compress(args, "distill", full)
            m = manifest["distill"]["metrics"]
            record(args.out, {"key": key, "weight": weight, "epochs": args.epochs, "seed": seed,
                              "val_acc": m["val_acc"], "alone": m.get("baseline_val_acc"), "wall_s": wall,
                              "teacher": m["teacher_val_acc"], "images_per_s": m["images_per_s"],
                              "store": m["teacher_outputs"].get("status"), "overrides": full})


def summary(path):
    rows = list(done(path).values())
    teacher = next((r for r in rows if r["key"] == "teacher"), None)
    if teacher:
        print(f"teacher: {teacher['val_acc']:.2f}% ({teacher.get('epochs')} epochs, "
              f"{teacher['wall_s'] / 60:.1f} min)")
    alone = [r for r in rows if r.get("alone") is not None]
    print("\n| student | epochs | val acc (mean ± std) | seeds | per seed | minutes a cell |")
    print("|---|---:|---:|---:|---|---:|")
    for r in alone:  # trained once, in the first cell (whose minutes include it and the store's build)
        print(f"| the student alone | {r['epochs']} | {r['alone']:.2f} | 1 (seed {r['seed']}) | - | - |")
    weights = sorted({r["weight"] for r in rows if "weight" in r})
    for weight in weights:
        at = [r for r in rows if r.get("weight") == weight]
        accs = [r["val_acc"] for r in at]
        m, s = mean_std(accs)
        print(f"| DIST KD weight {weight:g} | {at[0]['epochs']} | {m:.2f} ± {s:.2f} | {len(at)} | "
              f"{', '.join(f'{a:.2f}' for a in accs)} | "
              f"{sum(r['wall_s'] for r in at) / len(at) / 60:.1f} |")
    if len(weights) == 2:  # paired by seed: the same student initialisation, views and order under each weight
        by = {(r["weight"], r["seed"]): r["val_acc"] for r in rows if "weight" in r}
        gains = [by[weights[1], seed] - by[weights[0], seed] for seed in sorted({s for _, s in by})
                 if (weights[0], seed) in by and (weights[1], seed) in by]
        if gains:
            m, s = mean_std(gains)
            print(f"\nweight {weights[1]:g} - weight {weights[0]:g}, paired by seed: {m:+.2f} ± {s:.2f} points "
                  f"({', '.join(f'{g:+.2f}' for g in gains)})")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--weights", default="1,2", type=lambda s: [float(x) for x in s.split(",")])
    p.add_argument("--epochs", type=int, default=40, help="distill epochs of every cell")
    p.add_argument("--teacher-epochs", type=int, default=30)
    run_then_summarize(p, run, lambda args: summary(args.out))


if __name__ == "__main__":
    main()
