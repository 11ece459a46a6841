"""The distillation table, through the product: every cell is a `compress run --stages distill` in one run
directory, so the teacher is trained once and each teacher-output store is built once and reused by every seed,
method and schedule that shares its key (grouped so a store is never rebuilt).

Cells (3 seeds each unless --seeds): the student trained alone (distill.baseline, same views) and Hinton KD,
DKD, DIST, standardized KD at the short and the long schedule; standardized KD with mixup and with cutmix at the
long schedule (each with its own alone-with-the-same-mixing baseline); standardized KD with unlabelled images;
standardized KD with top-k stores (k = 3, 5 of 10 classes); QAT + export (with the PTQ file) of the best
long-schedule student of each seed, right after its cell. The longest cells (unlabelled images and mixing at the
long schedule) run last. Results go to a JSON-lines file as they come (rerunning skips cells already there).

    python benchmarks/bench_kd_table.py --config configs/cifar10.yaml --set data.root=../shared/data/cifar10-dev \
        --unlabeled ../shared/data/cifar10-unlabeled --work /tmp/kdtable --out benchmarks/results/kd_table.jsonl
    python benchmarks/bench_kd_table.py --out benchmarks/results/kd_table.jsonl --summary   # print the table

--variant NAME=KEY=VALUE[,KEY=VALUE] runs only standardized KD with those overrides (a temperature, a weight,
another student with "+NAME") at --short and --long, for the settings sweep in BENCHMARKS.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

METHODS = {  # the papers' CIFAR settings (TOOLCHAIN.md): the weights of CE and of the logit loss, and the temperature
    # (explicit: configs/cifar10.yaml has set T 1 since the table's first rows were measured with the papers' T)
    "hinton": ["distill.kd.method=hinton", "distill.ce_weight=0.1", "distill.kd.weight=0.9",
               "distill.kd.temperature=4"],
    "dkd": ["distill.kd.method=dkd", "distill.ce_weight=1.0", "distill.kd.weight=1.0", "distill.kd.temperature=4"],
    # KD weight 1: the weight the published table was measured with; DIST's default is now the official code's 2
    # (BENCHMARKS.md, "DIST's weight": within noise of 1 on cifar10-dev)
    "dist": ["distill.kd.method=dist", "distill.ce_weight=1.0", "distill.kd.weight=1.0", "distill.kd.temperature=4"],
    "standardized": ["distill.kd.method=standardized", "distill.ce_weight=0.1", "distill.kd.weight=9.0",
                     "distill.kd.temperature=2"],
}
# the student alone as a distill cell of its own: no loss needs the teacher, so no store is read or built
ALONE = ["distill.kd.weight=0", "distill.ce_weight=1.0"]


def cells(args):
    """(group, name, schedule, seed, overrides, with_baseline) in run order; a group shares one store."""
    if args.alone:  # only the student alone (cross-entropy only, no teacher, no store) at these schedules
        return [("none", "alone", epochs, seed, ALONE, False) for epochs in args.alone for seed in args.seeds]
    if args.variant:  # only the variants: standardized KD with other settings, beside the dense cells' student
        # alone, or (a name that starts with "+", e.g. another student) beside its own student alone
        return [("dense", f"standardized {name.lstrip('+')}", epochs, seed, METHODS["standardized"] + overrides,
                 name.startswith("+"))
                for epochs in dict.fromkeys((args.short, args.long)) for seed in args.seeds
                for name, overrides in args.variant]
    out = []
    for group, extra, names in (("dense", [], list(METHODS)),):
        for epochs in (args.short, args.long):
            for seed in args.seeds:
                for i, method in enumerate(names):
                    out.append((group, method, epochs, seed, METHODS[method] + extra, i == 0))
    for k in (3, 5):
        for seed in args.seeds:
            out.append((f"top{k}", f"standardized top-{k}", args.short, seed,
                        METHODS["standardized"] + [f"distill.store.top_k={k}"], False))
    if args.unlabeled:
        for seed in args.seeds:
            out.append(("unlabeled", "standardized+unlabeled", args.unlabeled_epochs, seed,
                        METHODS["standardized"] + [f"data.unlabeled={args.unlabeled}"], True))
    # the longest cells last: a table cut short still has every cell above
    if args.unlabeled and args.unlabeled_epochs != args.long:
        for seed in args.seeds:
            out.append(("unlabeled", "standardized+unlabeled", args.long, seed,
                        METHODS["standardized"] + [f"data.unlabeled={args.unlabeled}"], True))
    if args.patience:  # the best recipe, and the student alone, on a schedule past the long one
        for seed in args.seeds:
            out.append(("dense", "standardized", args.patience, seed, METHODS["standardized"], True))
    for mix in ("mixup", "cutmix"):
        for seed in args.seeds:
            out.append((mix, f"standardized+{mix}", args.long, seed, METHODS["standardized"] + [f"distill.mix={mix}"],
                        True))
    return out


BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); from compress.cli import main; main(sys.argv[1:])"


def compress(args, stages, overrides):
    """`compress run` of the installed package, or (--code DIR) of a frozen copy of the code in DIR, so the
    cells of a table that runs for hours all measure the same code."""
    exe = ([sys.executable, "-c", BOOT, args.code] if args.code else
           [os.path.join(os.path.dirname(sys.executable), "compress")])
    cmd = [*exe, "run", "--run-dir", args.work, "--stages", stages, "--set", "train.progress=false"]
    cmd += (["-c", args.config] if args.config else []) + [a for o in [*args.set, *overrides] for a in ("--set", o)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\nfailed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(args.work, "manifest.json")) as f:
        return json.load(f)["stages"], round(time.perf_counter() - start, 1)


def done(path):
    found = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                found[r["key"]] = r
    return found


def record(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: row.get(k) for k in ("key", "val_acc", "alone", "wall_s", "store")}), flush=True)


def run(args):
    finished = done(args.out)
    if "teacher" not in finished:
        manifest, wall = compress(args, "teacher", [])
        m = manifest["teacher"]["metrics"]  # the stage's own time (this call may have found it done)
        record(args.out, {"key": "teacher", "val_acc": m["val_acc"], "wall_s": manifest["teacher"]["seconds"],
                          "metrics": m})
    for group, name, epochs, seed, overrides, baseline in cells(args):
        key = f"{name}@{epochs}/s{seed}"
        if key in args.skip:
            continue
        full = [f"seed={seed}", f"distill.epochs={epochs}", f"distill.baseline={'true' if baseline else 'false'}",
                *overrides]
        if key not in finished:
            manifest, wall = compress(args, "distill", full)
            m = manifest["distill"]["metrics"]
            record(args.out, {"key": key, "group": group, "name": name, "epochs": epochs, "seed": seed,
                              "val_acc": m["val_acc"], "alone": m.get("baseline_val_acc"), "wall_s": wall,
                              "teacher": m["teacher_val_acc"], "images_per_s": m["images_per_s"],
                              "store": m["teacher_outputs"].get("status"), "teacher_outputs": m["teacher_outputs"],
                              "overrides": full, "own_alone": bool(args.variant and baseline)})
        if key in args.export_keys and f"export {key}" not in finished:
            # "distill" is listed so a cell recorded earlier (a table that was interrupted between a cell and its
            # export) is retrained if the run directory has moved on; when it has not, the stage is found done
            manifest, wall = compress(args, "distill,qat,export", full)
            m = manifest["distill"]["metrics"]
            e, q = manifest["export"]["metrics"], manifest["qat"]["metrics"]
            record(args.out, {"key": f"export {key}", "float": m["val_acc"], "qat_int8": q["int8_acc"],
                              "fp32_onnx": e["fp32_onnx_acc"], "int8_onnx": e["int8_onnx_acc"],
                              "ptq_onnx": e.get("ptq_onnx_acc"), "int8_speedup": e["int8_speedup"],
                              "deploy": e.get("deploy"), "wall_s": wall, "metrics": {"qat": q, "export": e}})


def mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def setting(r, key, default=None):
    """The value a cell ran with for `key`: its last override of it, or `default`."""
    found = [o.split("=", 1)[1] for o in r.get("overrides", []) if o.startswith(key + "=")]
    return found[-1] if found else default


def alone_label(r):
    """The student alone a cell is paired with: the same student on the same augmentation, mixed too where the
    cell trained its own student alone with distill.mix (one that did not is paired with the student a user would
    otherwise have trained, unmixed). Cells that trained the same student alone share a label, so their seeds
    pool."""
    student = (setting(r, "model.student") or "").rpartition(":")[2]
    mix = setting(r, "distill.mix", "none")
    mixed = f"+{mix}" if mix != "none" and setting(r, "distill.baseline") == "true" else ""
    return " ".join(p for p in ("alone", student, setting(r, "data.augment", ""), mixed) if p)


def same_student(r):
    return setting(r, "model.student") is None


def summary(path, alone_from=()):
    rows = list(done(path).values())
    teacher = next((r for r in rows if r["key"] == "teacher"), None)
    if teacher:
        print(f"teacher: {teacher['val_acc']:.2f}% ({teacher['wall_s'] / 60:.1f} min)")
    # the student alone of another table (it trains without a teacher, so a table with another teacher can be
    # paired with it seed by seed instead of training it again)
    wanted = {(label, r["epochs"]) for r in rows if "name" in r for label in (alone_label(r), "alone")}
    others = [r for other in alone_from for r in done(other).values()
              if "name" in r and (alone_label(r), r["epochs"]) in wanted]
    by = {}
    for r in rows:
        if "name" in r and r["name"] != "alone":  # the cells of --alone join the alone rows below
            by.setdefault((r["name"], r["epochs"]), []).append(r)
    # the student alone, per (label, epochs, seed): a cell that trained it again got the same accuracy to the
    # last digit (the stage is deterministic for a seed), so it is counted once
    alone = {}
    for r in others + rows:  # this table's own student alone, where it has one, over another table's
        if "name" in r and r.get("alone") is not None:
            alone.setdefault((alone_label(r), r["epochs"]), {})[r["seed"]] = r["alone"]
        if r.get("name") == "alone":  # a cell that trained only the student alone (--alone)
            alone.setdefault(("alone", r["epochs"]), {})[r["seed"]] = r["val_acc"]
    print("\n| student | epochs | val acc (mean ± std) | vs alone (same schedule, paired by seed) | "
          "vs the recipe's alone | seeds | per seed |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for (label, epochs), per_seed in sorted(alone.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        m, s = mean_std(list(per_seed.values()))
        print(f"| {label} | {epochs} | {m:.2f} ± {s:.2f} | - | - | {len(per_seed)} | "
              f"{', '.join(f'{a:.2f}' for a in per_seed.values())} |")

    def paired(rs, label):  # mean ± std of (cell - its seed's student alone), over the seeds that have both
        base = alone.get((label, rs[0]["epochs"]), {})
        gains = [r["val_acc"] - base[r["seed"]] for r in rs if r["seed"] in base]
        if not gains:
            return "-"
        m, s = mean_std(gains)
        return f"{m:+.2f} ± {s:.2f}" + (f" ({len(gains)} seeds)" if len(gains) != len(rs) else "")

    for (name, epochs), rs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        accs = [r["val_acc"] for r in rs]
        m, s = mean_std(accs)
        own = {alone_label(r) for r in rs}
        vs_own = paired(rs, own.pop()) if len(own) == 1 else "- (seeds differ)"  # some trained their own alone
        # the same student beside the recipe's student alone (pad-and-crop views, no mixing): for a variant that
        # trains its own alone with other augmentation, what a user would have had without distilling
        vs_recipe = paired(rs, "alone") if all(same_student(r) for r in rs) else "-"
        print(f"| {name} | {epochs} | {m:.2f} ± {s:.2f} | {vs_own} | {vs_recipe} | {len(accs)} | "
              f"{', '.join(f'{a:.2f}' for a in accs)} |")
    exports = [r for r in rows if r["key"].startswith("export")]
    if exports:
        print("\n| exported student | float (PyTorch) | fp32 ONNX | QAT int8 ONNX | PTQ int8 ONNX | QAT - PTQ | "
              "int8 - float | int8 / fp32 speed | deploys |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in exports:
        ptq = r.get("ptq_onnx")
        ptq_text, gap = ("-", "-") if ptq is None else (f"{ptq:.2f}", f"{r['int8_onnx'] - ptq:+.2f}")
        print(f"| {r['key'][7:]} | {r['float']:.2f} | {r['fp32_onnx']:.2f} | {r['int8_onnx']:.2f} | {ptq_text} | "
              f"{gap} | {r['int8_onnx'] - r['float']:+.2f} | {r['int8_speedup']:.2f}x | {r.get('deploy', '-')} |")
    with_ptq = [r for r in exports if r.get("ptq_onnx") is not None]
    if len(with_ptq) > 1:
        m, s = mean_std([r["int8_onnx"] - r["ptq_onnx"] for r in with_ptq])
        d, e = mean_std([r["int8_onnx"] - r["float"] for r in with_ptq])
        print(f"\nQAT int8 - PTQ int8: {m:+.2f} ± {s:.2f} points; QAT int8 - float: {d:+.2f} ± {e:.2f} points "
              f"({len(with_ptq)} seeds)")


def add_run_args(p):
    """The arguments every through-the-product cell table takes (this script and bench_kd_default.py)."""
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--work", help="the run directory shared by every cell")
    p.add_argument("--code", help="run the compress package found in this folder (a frozen copy of compress/ and "
                                  "stages/) instead of the installed one")
    p.add_argument("--out", required=True, help="JSON-lines results file")
    p.add_argument("--summary", action="store_true", help="only print the table from --out")


def run_then_summarize(p, run_cells, summarize):
    args = p.parse_args()
    if not args.summary:
        if not args.work:
            p.error("--work is required to run cells")
        run_cells(args)
    summarize(args)


def variant(text):
    name, _, overrides = text.partition("=")
    if not name or "=" not in overrides:
        raise argparse.ArgumentTypeError(f"expected NAME=KEY=VALUE[,KEY=VALUE], got {text!r}")
    return name, overrides.split(",")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--unlabeled", help="folder of unlabelled images (data.unlabeled) for the unlabelled cells")
    p.add_argument("--short", type=int, default=40)
    p.add_argument("--long", type=int, default=160)
    p.add_argument("--patience", type=int, help="also standardized KD and the student alone at this many epochs")
    p.add_argument("--alone", type=lambda s: [int(x) for x in s.split(",")], metavar="EPOCHS[,EPOCHS]",
                   help="run only the student alone (cross-entropy only, no teacher) at these schedules: how far it "
                        "gets when it trains longer than the distilled one")
    p.add_argument("--unlabeled-epochs", type=int, default=80, help="a second schedule for the unlabelled cells")
    p.add_argument("--export-keys", default="standardized@160/s0,standardized@160/s1,standardized@160/s2",
                   type=lambda s: s.split(","), help="the cells whose students go through QAT+export (comma-separated)")
    p.add_argument("--variant", action="append", default=[], type=variant, metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                   help="run only standardized KD with these overrides at --short and --long (repeatable); the gain "
                        "is taken against the student alone of the dense cells, or, for a NAME that starts with "
                        "'+' (another student), against that student alone, trained by the cell")
    p.add_argument("--skip", default=[], type=lambda s: s.split(","), help="cells to leave out (comma-separated keys)")
    p.add_argument("--alone-from", action="append", default=[], metavar="JSONL",
                   help="also pair with the student alone recorded in this results file (a table with another teacher "
                        "need not train the student alone again: it does not depend on the teacher)")
    run_then_summarize(p, run, lambda args: summary(args.out, args.alone_from))


if __name__ == "__main__":
    main()
