"""Which logit loss the built-in default should use: every candidate through the product on the default
dataset (`compress run` with no config: mnist5k, resnet14 -> compact_cnn), over seeds and two schedules.

The teacher is trained once in --work; each cell is a `compress run --stages distill` there (the teacher-output
store is built once and reused). The first candidate's cells also train the student alone (distill.baseline,
same views), so each row reads against it.

    python benchmarks/bench_kd_default.py --work /tmp/kddef/run --out benchmarks/results/kd_default.jsonl
    python benchmarks/bench_kd_default.py --out benchmarks/results/kd_default.jsonl --summary
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kd_table import add_run_args, compress, done, mean_std, record, run_then_summarize  # noqa: E402

CANDIDATES = {  # name -> the overrides; explicit, so the table does not move when the built-in default does
    "hinton CE 0.5 KD 0.5 (built-in until now)": ["distill.kd.method=hinton", "distill.ce_weight=0.5",
                                                  "distill.kd.weight=0.5", "distill.kd.temperature=4"],
    "hinton CE 0.1 KD 0.9 (paper)": ["distill.kd.method=hinton", "distill.ce_weight=0.1", "distill.kd.weight=0.9",
                                     "distill.kd.temperature=4"],
    "dkd CE 1 KD 1 (paper)": ["distill.kd.method=dkd", "distill.ce_weight=1.0", "distill.kd.weight=1.0",
                              "distill.kd.temperature=4"],
    "dist CE 1 KD 1 (paper)": ["distill.kd.method=dist", "distill.ce_weight=1.0", "distill.kd.weight=1.0",
                               "distill.kd.temperature=4"],
    "standardized CE 0.1 KD 9 (paper)": ["distill.kd.method=standardized", "distill.ce_weight=0.1",
                                         "distill.kd.weight=9.0", "distill.kd.temperature=2"],
    "standardized CE 0.1 KD 9 T 1": [
        "distill.kd.method=standardized", "distill.ce_weight=0.1", "distill.kd.weight=9.0",
        "distill.kd.temperature=1"],
}


def run(args):
    finished = done(args.out)
    if "teacher" not in finished:
        manifest, _ = compress(args, "teacher", [])
        m = manifest["teacher"]["metrics"]
        record(args.out, {"key": "teacher", "val_acc": m["val_acc"], "wall_s": manifest["teacher"]["seconds"]})
    for epochs in args.epochs:
        for seed in args.seeds:
            for i, (name, overrides) in enumerate(CANDIDATES.items()):
                key = f"{name}@{epochs}/s{seed}"
                if key in finished:
                    continue
                full = [f"seed={seed}", f"distill.epochs={epochs}",
                        f"distill.baseline={'true' if i == 0 else 'false'}", *overrides]
                manifest, wall = compress(args, "distill", full)
                m = manifest["distill"]["metrics"]
                record(args.out, {"key": key, "name": name, "epochs": epochs, "seed": seed, "val_acc": m["val_acc"],
                                  "alone": m.get("baseline_val_acc"), "wall_s": wall,
                                  "teacher": m["teacher_val_acc"], "images_per_s": m["images_per_s"],
                                  "overrides": full})


def summary(path):
    rows = [r for r in done(path).values() if "name" in r]
    teacher = done(path).get("teacher")
    if teacher:
        print(f"teacher: {teacher['val_acc']:.2f}%")
    print("\n| student | epochs | val acc (mean ± std) | vs alone | per seed |")
    print("|---|---:|---:|---:|---|")
    for epochs in sorted({r["epochs"] for r in rows}):
        at = [r for r in rows if r["epochs"] == epochs]
        alone = [r["alone"] for r in at if r.get("alone") is not None]
        if alone:
            m, s = mean_std(alone)
            print(f"| alone | {epochs} | {m:.2f} ± {s:.2f} | - | {', '.join(f'{a:.2f}' for a in alone)} |")
        for name in CANDIDATES:
            accs = [r["val_acc"] for r in at if r["name"] == name]
            if not accs:
                continue
            m, s = mean_std(accs)
            gain = f"{m - mean_std(alone)[0]:+.2f}" if alone else "-"
            print(f"| {name} | {epochs} | {m:.2f} ± {s:.2f} | {gain} | {', '.join(f'{a:.2f}' for a in accs)} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--epochs", default="8,32", type=lambda s: [int(x) for x in s.split(",")],
                   help="student schedules (the default run's 8 epochs and a longer one)")
    run_then_summarize(p, run, lambda args: summary(args.out))


if __name__ == "__main__":
    main()
