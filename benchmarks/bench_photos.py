"""The photos recipe on real photos, through the product: `compress run -c photos` on an image folder, the teacher
trained once and the students (distilled, alone, QAT int8, PTQ int8) over several seeds - accuracy, latency and
wall time per stage, as a user gets them.

    python benchmarks/bench_photos.py --root ../shared/data/imagenette-dev --work /tmp/photos \\
        --seeds 0,1,2 --out benchmarks/results/photos.json          # ~1 h per seed on 2 cores

A run directory already under --work is resumed, as `compress run` does (its wall time is then only the resumed
part). Seed 0 is one whole `compress run` from an empty run directory (the figure a user waits for); seeds 1 and 2 reuse
that teacher (a copy of its run directory's teacher/, so `compress run` skips it) and run distill, qat and export.
Every run shares one decoded-pixel cache (data.cache_dir), as runs in one place do; the first run's decode is in
its teacher stage's time. --set passes overrides to every run (e.g. a shorter schedule to try the script).
--alone-from reuses the students trained alone of an earlier --work (the distill stage checks they still apply:
nothing they depend on, which excludes the teacher, changed); their training time is then not in the figures.
--summary prints the tables from --out without running anything.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

STAGES = ("teacher", "distill", "qat", "export")


def compress(run_dir, args, seed, stages=None):
    cmd = [os.path.join(os.path.dirname(sys.executable), "compress"), "run", "-c", args.config, "--run-dir", run_dir,
           "--set", f"data.root={args.root}", "--set", f"data.cache_dir={os.path.join(args.work, 'pixels')}",
           "--set", f"seed={seed}", "--set", "train.progress=false"]
    cmd += ["--stages", stages] if stages else []
    cmd += [a for o in args.set for a in ("--set", o)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\nfailed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall


def copy_teacher(src, dst):
    """A run directory holding only the trained teacher (its folder, config and manifest entry)."""
    os.makedirs(dst)
    shutil.copytree(os.path.join(src, "teacher"), os.path.join(dst, "teacher"))
    shutil.copy(os.path.join(src, "config.yaml"), os.path.join(dst, "config.yaml"))
    with open(os.path.join(src, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["stages"] = {"teacher": manifest["stages"]["teacher"]}
    with open(os.path.join(dst, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def collect(run_dir, seed, wall):
    with open(os.path.join(run_dir, "manifest.json")) as f:
        stages = json.load(f)["stages"]
    with open(os.path.join(run_dir, "export", "export.json")) as f:
        export = json.load(f)
    d, q, x = stages["distill"]["metrics"], stages["qat"]["metrics"], stages["export"]["metrics"]
    lat = x["latency_ms"]

    def ms(kind, batch):
        cells = lat.get(kind, {})
        best = max((int(k.split("_t")[1]) for k in cells if k.startswith(f"b{batch}_")), default=None)
        return cells.get(f"b{batch}_t{best}")

    return {"seed": seed, "wall_s": round(wall, 1),
            "stage_s": {s: stages[s].get("seconds") for s in STAGES},
            "teacher_acc": stages["teacher"]["metrics"]["val_acc"], "distilled_acc": d["val_acc"],
            "alone_acc": d.get("baseline_val_acc"), "gain_p": d.get("gain_p"), "qat_int8_acc": x["int8_onnx_acc"],
            "ptq_int8_acc": x.get("ptq_onnx_acc"), "fp32_onnx_acc": x["fp32_onnx_acc"],
            "qat_stage_int8_acc": q["int8_acc"],
            "deploy": x["deploy"], "deploy_why": x["deploy_why"],
            "latency_ms": {kind: {b: ms(kind, b) for b in (1, 64)} for kind in ("teacher", "fp32", "int8", "ptq")},
            "sizes": export.get("size_bytes"),
            "images_per_s": {s: stages[s]["metrics"].get("images_per_s") for s in ("teacher", "distill", "qat")}}


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def summary(rows):
    print("| seed | teacher | distilled | alone | gain | QAT int8 | PTQ int8 | deploy | whole run | teacher | distill "
          "| qat | export |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["stage_s"]
        print(f"| {r['seed']} | {r['teacher_acc']:.2f} | {r['distilled_acc']:.2f} | {r['alone_acc']:.2f} | "
              f"{r['distilled_acc'] - r['alone_acc']:+.2f} (p {r['gain_p']}) | {r['qat_int8_acc']:.2f} | "
              f"{r['ptq_int8_acc']:.2f} | {r['deploy']} | {r['wall_s'] / 60:.1f} min | "
              + " | ".join(f"{(s[k] or 0) / 60:.1f}" for k in STAGES) + " |")
    print(f"\nmean ± std over {len(rows)} seeds: distilled {mean_std([r['distilled_acc'] for r in rows])}, alone "
          f"{mean_std([r['alone_acc'] for r in rows])}, QAT int8 {mean_std([r['qat_int8_acc'] for r in rows])}, PTQ "
          f"int8 {mean_std([r['ptq_int8_acc'] for r in rows])}, int8 - alone "
          f"{mean_std([r['qat_int8_acc'] - r['alone_acc'] for r in rows])}")
    print("\n| latency (onnxruntime, ms) | batch 1 | batch 64 |\n|---|---:|---:|")
    for kind, label in (("teacher", "teacher fp32"), ("fp32", "student fp32"), ("int8", "student int8 (QAT)"),
                        ("ptq", "student int8 (PTQ)")):
        cells = [r["latency_ms"][kind] for r in rows]
        print(f"| {label} | {mean_std([c['1'] if '1' in c else c.get(1) for c in cells])} | "
              f"{mean_std([c['64'] if '64' in c else c.get(64) for c in cells])} |")


def copy_alone(src, dst):
    """The student trained alone from run directory `src` put into `dst` before its run: the distill stage reuses it
    when nothing it depends on differs (the teacher is not among those), and trains it again otherwise."""
    os.makedirs(os.path.join(dst, "distill", "baseline"), exist_ok=True)
    for name in ("baseline.safetensors", os.path.join("baseline", "metrics.json")):
        shutil.copy(os.path.join(src, "distill", name), os.path.join(dst, "distill", name))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="photos")
    p.add_argument("--root", default="../shared/data/imagenette-dev")
    p.add_argument("--work", default="/tmp/photos")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--teacher-seed", type=int, default=0, help="the seed whose run trains the teacher the others copy")
    p.add_argument("--alone-from", help="a --work folder of an earlier run of this script whose students trained "
                                        "alone (seed<N>/distill/baseline*) the new runs reuse where they still apply")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out", default="benchmarks/results/photos.json")
    p.add_argument("--summary", action="store_true")
    args = p.parse_args()
    if args.summary:
        with open(args.out) as f:
            summary(json.load(f)["runs"])
        return
    args.root = os.path.abspath(args.root)
    os.makedirs(args.work, exist_ok=True)
    rows = []
    if os.path.exists(args.out):  # rows of earlier invocations (other seeds) are kept
        with open(args.out) as f:
            rows = json.load(f)["runs"]
    first = os.path.join(args.work, f"seed{args.teacher_seed}")

    def save(row):
        rows[:] = sorted([r for r in rows if r["seed"] != row["seed"]] + [row], key=lambda r: r["seed"])
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "runs": rows}, f, indent=1)

    for seed in [int(s) for s in args.seeds.split(",")]:
        run = os.path.join(args.work, f"seed{seed}")
        fresh = not os.path.exists(run)
        if fresh and seed != args.teacher_seed:
            copy_teacher(first, run)
        wall = 0.0
        if seed == args.teacher_seed:  # the teacher first: a run directory begins empty
            wall += compress(run, args, seed, "teacher")
        if fresh and args.alone_from:
            copy_alone(os.path.join(args.alone_from, f"seed{seed}"), run)
        wall += compress(run, args, seed, "distill,qat,export")
        save(collect(run, seed, wall))
    summary(rows)


if __name__ == "__main__":
    main()
