"""Which student for photos? Candidates distilled from the photos recipe's trained teacher, each through the
product (`compress run -c photos --stages distill,qat,export --set model.student=...`), on the same stored
teacher outputs, pixels and seed: distilled accuracy, QAT and PTQ int8 accuracy, int8 and fp32 latency in
onnxruntime at batch 1 and 64, size, and the distill stage's speed and time.

    python benchmarks/bench_photo_students.py --teacher-from /tmp/photos_v2/seed0 --work /tmp/students \\
        --epochs 20 --out benchmarks/results/photo_students.json

--teacher-from is a finished photos run (bench_photos.py's seed 0): its teacher/ and its teacher-output store
(distill/teacher_outputs/) are copied into each candidate's run directory, so every candidate learns from the same
teacher outputs and none pays for the store. Pixels come from --pixels (the decoded-pixel cache that run used).
The student alone is not trained (distill.baseline false): this compares students, not distillation. A candidate
that fails (a model QAT cannot trace, say) is recorded with its error and the others go on. Run one at a time:
two trainings beside each other on 2 cores slow each other many times over.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from bench_photos import copy_teacher  # run from the repository root: benchmarks/ is on sys.path

CANDIDATES = ["resnet18_half", "resnet10_half", "torchvision:mobilenet_v2", "torchvision:mobilenet_v3_small",
              "torchvision:regnet_y_400mf"]


def prepare(src, dst):
    """A run directory holding the teacher and the teacher-output store of `src`."""
    copy_teacher(src, dst)
    shutil.copytree(os.path.join(src, "distill", "teacher_outputs"), os.path.join(dst, "distill", "teacher_outputs"))


def run_dir_of(work, label):
    return os.path.join(work, "".join(c if c.isalnum() or c in "._-" else "_" for c in label))


def run(args, run_dir, student):
    cmd = [os.path.join(os.path.dirname(sys.executable), "compress"), "run", "-c", "photos", "--run-dir", run_dir,
           "--stages", "distill,qat,export", "--set", f"data.root={args.root}", "--set",
           f"data.cache_dir={args.pixels}", "--set", f"model.student={student}", "--set",
           f"distill.epochs={args.epochs}", "--set", "distill.baseline=false", "--set", f"seed={args.seed}",
           "--set", "train.progress=false"]
    cmd += [a for o in args.set for a in ("--set", o)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc, time.perf_counter() - start, cmd


def collect(run_dir):
    with open(os.path.join(run_dir, "manifest.json")) as f:
        stages = json.load(f)["stages"]
    d, q, x = (stages[s]["metrics"] for s in ("distill", "qat", "export"))
    lat = x["latency_ms"]

    def ms(kind, batch):
        cells = lat.get(kind, {})
        best = max((int(k.split("_t")[1]) for k in cells if k.startswith(f"b{batch}_")), default=None)
        return cells.get(f"b{batch}_t{best}")

    return {"params": x.get("params"), "distilled_acc": d["val_acc"], "qat_int8_acc": x["int8_onnx_acc"],
            "ptq_int8_acc": x.get("ptq_onnx_acc"), "fp32_onnx_acc": x["fp32_onnx_acc"],
            "int8_bytes": x.get("int8_bytes"), "fp32_bytes": x.get("fp32_bytes"), "deploy": x["deploy"],
            "float_layers": x.get("float_layers"),
            "latency_ms": {k: {str(b): ms(k, b) for b in (1, 64)} for k in ("fp32", "int8", "ptq")},
            "distill_images_per_s": d.get("images_per_s"), "qat_images_per_s": q.get("images_per_s"),
            "stage_s": {s: stages[s].get("seconds") for s in ("distill", "qat", "export")}}


def retime(args, rows):
    """Each finished candidate's fp32 and int8 files timed again by `compress bench` (batch 1 and 64, 1 and 2
    threads), the candidates taking turns over `args.retime` rounds: the export stage timed each candidate on its
    own, minutes apart, on a machine whose speed moves; this puts the candidates side by side. A cell's figure is
    the median over the rounds."""
    exe = os.path.join(os.path.dirname(sys.executable), "compress")
    done = [r for r in rows if "error" not in r]
    seen = {r["label"] if "label" in r else r["student"]: {} for r in done}
    for _ in range(args.retime):
        for r in done:
            label = r.get("label", r["student"])
            export = os.path.join(run_dir_of(args.work, label), "export")
            out = subprocess.run([exe, "bench", os.path.join(export, "model.fp32.onnx"),
                                  os.path.join(export, "model.int8.onnx"), "--batch", "1,64", "--threads", "1,2",
                                  "--repeats", "100", "--json"], capture_output=True, text=True, check=True).stdout
            for kind, f in zip(("fp32", "int8"), json.loads(out)["files"]):
                for c in f["cells"]:
                    seen[label].setdefault(f"{kind}_b{c['batch']}_t{c['threads']}", []).append(c["ms"])
    for r in done:
        r["bench_ms"] = {k: statistics.median(v) for k, v in seen[r.get("label", r["student"])].items()}
        r["bench_rounds"] = args.retime


def summary(rows):
    print("| student (variant) | params | distilled | QAT int8 | PTQ int8 | int8 b1 / b64 ms | fp32 b1 / b64 ms | "
          "int8 vs fp32 b1 / b64 | int8 size | distill img/s | distill + qat + export |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| `{r.get('label', r['student'])}` | failed: {r['error'][:120]} |")
            continue
        i, f = r["latency_ms"]["int8"], r["latency_ms"]["fp32"]
        if "bench_ms" in r:  # the side-by-side timing (--retime), at 2 threads as the export stage's
            b = r["bench_ms"]
            i, f = ({"1": b[f"{k}_b1_t2"], "64": b[f"{k}_b64_t2"]} for k in ("int8", "fp32"))
        s = r["stage_s"]
        print(f"| `{r.get('label', r['student'])}` | {r['params'] / 1e6:.2f} M | {r['distilled_acc']:.2f} | "
              f"{r['qat_int8_acc']:.2f} | {r['ptq_int8_acc']:.2f} | {i['1']:.2f} / {i['64']:.1f} | "
              f"{f['1']:.2f} / {f['64']:.1f} | "
              f"{f['1'] / i['1']:.2f}x / {f['64'] / i['64']:.2f}x | {r['int8_bytes'] / 1e6:.2f} MB | "
              f"{r['distill_images_per_s'] or 0:.0f} | {s['distill'] / 60:.1f} + {s['qat'] / 60:.1f} + "
              f"{s['export'] / 60:.1f} min |")
    timed = [r for r in rows if "bench_ms" in r]
    if timed:
        print(f"\nSide by side (`compress bench`, candidates in turns, median of {timed[0]['bench_rounds']} rounds), "
              "ms int8 / fp32 (int8's speed-up):\n\n| student | b1, 1 thread | b1, 2 threads | b64, 1 thread | "
              "b64, 2 threads |\n|---|---:|---:|---:|---:|")
        for r in timed:
            b = r["bench_ms"]
            cells = [f"{b[f'int8_{c}']:.2f} / {b[f'fp32_{c}']:.2f} ({b[f'fp32_{c}'] / b[f'int8_{c}']:.2f}x)"
                     for c in ("b1_t1", "b1_t2", "b64_t1", "b64_t2")]
            print(f"| `{r.get('label', r['student'])}` | " + " | ".join(cells) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher-from", default="/tmp/photos_v2/seed0")
    p.add_argument("--pixels", help="the decoded-pixel cache folder (default: pixels/ beside --teacher-from)")
    p.add_argument("--root", default="../shared/data/imagenette-dev")
    p.add_argument("--work", default="/tmp/students")
    p.add_argument("--students", default=",".join(CANDIDATES))
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="an override for every candidate (e.g. a KD loss)")
    p.add_argument("--label", help="the row's name (default: the student's); a row of the same name is replaced")
    p.add_argument("--out", default="benchmarks/results/photo_students.json")
    p.add_argument("--summary", action="store_true")
    p.add_argument("--retime", type=int, default=0, help="time the finished candidates' files again, side by side, "
                                                         "over this many rounds (no training)")
    args = p.parse_args()
    if args.summary:
        with open(args.out) as f:
            summary(json.load(f)["runs"])
        return
    args.root = os.path.abspath(args.root)
    args.pixels = os.path.abspath(args.pixels or os.path.join(os.path.dirname(args.teacher_from.rstrip("/")), "pixels"))
    rows = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)["runs"]
    if args.retime:
        retime(args, rows)
        with open(args.out, "w") as f:
            json.dump({"runs": rows}, f, indent=1)
        summary(rows)
        return
    for student in args.students.split(","):
        label = args.label or student
        run_dir = run_dir_of(args.work, label)
        if not os.path.exists(run_dir):
            prepare(args.teacher_from, run_dir)
        proc, wall, cmd = run(args, run_dir, student)
        row = {"label": label, "student": student, "epochs": args.epochs, "seed": args.seed, "set": args.set,
               "wall_s": round(wall, 1), "command": " ".join(sys.argv)}
        if proc.returncode:
            row["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        else:
            row.update(collect(run_dir))
        rows = [r for r in rows if r.get("label", r["student"]) != label] + [row]
        with open(args.out, "w") as f:
            json.dump({"runs": rows}, f, indent=1)
        print(f"{label}: {row.get('error') or row['qat_int8_acc']} ({wall / 60:.1f} min)", flush=True)
    summary(rows)


if __name__ == "__main__":
    main()
