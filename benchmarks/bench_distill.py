"""Does distillation pay, and what does the view cache buy? Everything through `compress run`.

Part 1 (results): the teacher is trained once; then for each seed the distill stage trains the student with
the config's distillation mix *and* the same student alone (distill.baseline: CE only, same initialisation,
schedule and seed); each extra --method (a named set of overrides) is trained over the same seeds. QAT and
export run on the first seed's distilled student. Prints mean +- std over the seeds, the int8 ONNX accuracy
next to the float student's, and the wall time of every part.

Part 2 (speed, --speed): augmented distillation with the teacher-output view cache (distill.views) against the
textbook KD loop - a plain PyTorch loop over the same augmented batches that runs the teacher on every batch -
side by side in one process, same models, batch, epochs and threads; images/s with the cache's build time
included. A third column runs the textbook loop with both models and every batch in channels-last, the layout
compress trains in, to separate what the layout buys from what the cache buys.
--speed-seeds also trains the stage with the teacher on every batch (distill.views=0) over the seeds,
to compare accuracy with the view cache's.

    python benchmarks/bench_distill.py --config configs/cifar10.yaml --set data.root=../shared/data/cifar10-dev
    python benchmarks/bench_distill.py --method "KD+hint=distill.hint.weight=0.25;distill.hint.student_layer=block2"
    python benchmarks/bench_distill.py --config configs/cifar10.yaml --set data.root=... --skip-results --speed
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compress.config import load_config  # noqa: E402
from compress.data import load_data, train_loader  # noqa: E402
from compress.losses import kd_loss  # noqa: E402
from compress.models import build_model  # noqa: E402


def compress_run(args, run_dir, stages, overrides=()):
    cmd = [os.path.join(os.path.dirname(sys.executable), "compress"), "run", "--run-dir", run_dir, "--stages", stages,
           "--set", "train.progress=false"]
    cmd += (["-c", args.config] if args.config else []) + [a for o in [*args.set, *overrides] for a in ("--set", o)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\nfailed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    manifest = json.load(open(os.path.join(run_dir, "manifest.json")))["stages"]
    return manifest, round(time.perf_counter() - start, 1)


def copy_teacher(src, dst):
    """A run directory holding only the trained teacher (its folder and manifest entry)."""
    os.makedirs(dst)
    shutil.copytree(os.path.join(src, "teacher"), os.path.join(dst, "teacher"))
    manifest = json.load(open(os.path.join(src, "manifest.json")))
    manifest["stages"] = {"teacher": manifest["stages"]["teacher"]}
    with open(os.path.join(dst, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def results(args, work):
    out = {"seeds": args.seeds, "walls": {}}
    teacher_dir = os.path.join(work, "teacher")
    manifest, out["walls"]["teacher"] = compress_run(args, teacher_dir, "teacher")
    out["teacher"] = manifest["teacher"]["metrics"]["val_acc"]
    print(f"teacher: {out['teacher']:.2f}% ({out['walls']['teacher']} s)", flush=True)
    methods = ({} if args.only_methods else {"distilled (config)": []}) | {name: list(o) for name, o in args.method}
    out["methods"] = {name: [] for name in methods}
    out["alone"] = []
    for seed in args.seeds:
        for name, overrides in methods.items():
            run_dir = os.path.join(work, f"{abs(hash(name))}-s{seed}")
            copy_teacher(teacher_dir, run_dir)
            extra = [f"seed={seed}", f"distill.baseline={'true' if name == 'distilled (config)' else 'false'}"]
            manifest, wall = compress_run(args, run_dir, "distill", [*extra, *overrides])
            m = manifest["distill"]["metrics"]
            out["methods"][name].append(m["val_acc"])
            if "baseline_val_acc" in m:
                out["alone"].append(m["baseline_val_acc"])
            out["walls"][f"distill {name} seed {seed}"] = wall
            print(f"seed {seed} {name}: {m['val_acc']:.2f}%" + (f", alone {m['baseline_val_acc']:.2f}%" if
                  "baseline_val_acc" in m else "") + f" ({wall} s)", flush=True)
            if seed == args.seeds[0] and name == "distilled (config)":
                manifest, out["walls"]["qat+export"] = compress_run(args, run_dir, "qat,export", extra)
                e = manifest["export"]["metrics"]
                out["int8"] = {"float_student": m["val_acc"], "qat_int8_torch": manifest["qat"]["metrics"]["int8_acc"],
                               "fp32_onnx": e["fp32_onnx_acc"], "int8_onnx": e["int8_onnx_acc"],
                               "int8_speedup": e["int8_speedup"], "float_layers": e["float_layers"]}
                print(f"int8: {out['int8']}", flush=True)
    return out


# ---------------------------------------------------------------- part 2


def textbook_kd(cfg, data, teacher, student, epochs, memory_format=torch.contiguous_format):
    """The textbook loop: the frozen teacher runs on every (augmented) batch."""
    d = cfg.distill
    teacher.to(memory_format=memory_format)
    student.to(memory_format=memory_format)
    optimizer = torch.optim.SGD(student.parameters(), lr=d.lr, momentum=d.momentum, nesterov=d.nesterov,
                                weight_decay=d.weight_decay)
    loader = train_loader(data.train, d.batch_size, 0, 1, cfg.seed)
    teacher.eval()
    images, start = 0, time.perf_counter()
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        student.train()
        for batch in loader:
            x = batch.x.contiguous(memory_format=memory_format)
            with torch.no_grad():
                t = teacher(x)
            s = student(x)
            loss = d.ce_weight * F.cross_entropy(s, batch.y) + d.kd.weight * kd_loss(s, t, d.kd.temperature)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            images += len(batch.y)
    return images / (time.perf_counter() - start)


def speed(args, work):
    """Interleaved: the distill stage with the view cache (its wall time, cache build included) and the textbook
    loop, for the same number of epochs."""
    if args.speed_epochs is None:
        args.speed_epochs = load_config(args.config, args.set).distill.epochs
    cfg = load_config(args.config, [*args.set, f"distill.epochs={args.speed_epochs}"])
    teacher_dir = os.path.join(work, "teacher")
    if not os.path.isdir(teacher_dir):
        compress_run(args, teacher_dir, "teacher")
    data = load_data(cfg.data, cfg.seed)
    teacher = build_model(cfg.model.teacher, data.input_shape, data.num_classes)
    from safetensors.torch import load_file

    teacher.load_state_dict(load_file(os.path.join(teacher_dir, "teacher", "model.safetensors")))
    order = ("view cache (compress)", "textbook loop", "textbook loop, channels-last")
    rows = {which: [] for which in order}
    n = len(data.train) * args.speed_epochs
    for r in range(args.speed_rounds):
        for which in (order if (r + args.speed_first_round) % 2 == 0 else order[::-1]):
            if which.startswith("textbook loop"):
                torch.manual_seed(cfg.seed)
                student = build_model(cfg.model.student, data.input_shape, data.num_classes)
                layout = torch.channels_last if which.endswith("channels-last") else torch.contiguous_format
                rows[which].append(textbook_kd(cfg, data, teacher, student, args.speed_epochs, layout))
            else:
                run_dir = os.path.join(work, f"speed{r}")
                copy_teacher(teacher_dir, run_dir)
                manifest, _ = compress_run(args, run_dir, "distill", [f"distill.epochs={args.speed_epochs}",
                                                                      "distill.baseline=false"])
                rows[which].append(n / manifest["distill"]["seconds"])
            print(f"  round {r + 1} {which}: {rows[which][-1]:.0f} images/s", flush=True)
    out = {"epochs": args.speed_epochs, "images_per_s": {k: statistics.median(v) for k, v in rows.items()},
           "rounds": rows}
    ips = out["images_per_s"]
    out["speedup"] = ips["view cache (compress)"] / ips["textbook loop"]
    out["speedup_channels_last"] = ips["view cache (compress)"] / ips["textbook loop, channels-last"]
    if args.speed_seeds:
        out["per_batch_teacher_acc"] = []
        for seed in args.seeds:
            run_dir = os.path.join(work, f"perbatch-s{seed}")
            copy_teacher(teacher_dir, run_dir)
            manifest, wall = compress_run(args, run_dir, "distill", [f"seed={seed}", "distill.views=0",
                                                                     "distill.baseline=false"])
            out["per_batch_teacher_acc"].append(manifest["distill"]["metrics"]["val_acc"])
            print(f"  seed {seed} teacher on every batch: {out['per_batch_teacher_acc'][-1]:.2f}% ({wall} s)")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--method", action="append", default=[], metavar="NAME=K=V;K=V",
                        type=lambda s: (s.split("=", 1)[0], s.split("=", 1)[1].split(";")))
    parser.add_argument("--only-methods", action="store_true",
                        help="train only the --method mixes (not the config's mix and its student-alone baseline)")
    parser.add_argument("--skip-results", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--speed-epochs", type=int, default=None,
                        help="epochs of both loops (default: the config's distill.epochs - the view cache pays off "
                             "over many epochs per view, so a short comparison understates it)")
    parser.add_argument("--speed-rounds", type=int, default=2)
    parser.add_argument("--speed-first-round", type=int, default=0,
                        help="number the rounds from here (1: start with the reversed order, to add a round to an "
                             "earlier one-round run)")
    parser.add_argument("--speed-seeds", action="store_true")
    parser.add_argument("--work", default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="bench-distill-")
    begin = time.perf_counter()
    out = {"command": " ".join(sys.argv)}
    if not args.skip_results:
        out["results"] = res = results(args, work)
        seeds = ", ".join(map(str, args.seeds))
        print(f"\n| model | val acc, mean ± std over seeds {seeds} | per seed |\n|---|---:|---|")
        print(f"| teacher (trained once) | {res['teacher']:.2f} | - |")
        if res["alone"]:
            m, s = mean_std(res["alone"])
            alone = ", ".join(f"{v:.2f}" for v in res["alone"])
            print(f"| student alone (CE; distill.baseline) | {m:.2f} ± {s:.2f} | {alone} |")
        for name, accs in res["methods"].items():
            m, s = mean_std(accs)
            print(f"| {name} | {m:.2f} ± {s:.2f} | {', '.join(f'{v:.2f}' for v in accs)} |")
        if "int8" in res:
            i = res["int8"]
            print(f"\nseed {args.seeds[0]}: float student {i['float_student']:.2f}%, QAT int8 (torch) "
                  f"{i['qat_int8_torch']:.2f}%, fp32 ONNX {i['fp32_onnx']:.2f}%, int8 ONNX {i['int8_onnx']:.2f}% "
                  f"({i['int8_speedup']:.2f}x fp32 speed; float layers: {', '.join(i['float_layers']) or 'none'})")
    if args.speed:
        out["speed"] = sp = speed(args, work)
        print(f"\nview cache vs textbook KD loop, {sp['epochs']} epochs: "
              + ", ".join(f"{k} {v:.0f} images/s" for k, v in sp["images_per_s"].items())
              + f" -> {sp['speedup']:.2f}x (against the channels-last textbook loop "
              f"{sp['speedup_channels_last']:.2f}x)")
        if "per_batch_teacher_acc" in sp:
            m, s = mean_std(sp["per_batch_teacher_acc"])
            print(f"teacher on every batch (distill.views=0): {m:.2f} ± {s:.2f} "
                  f"({', '.join(f'{v:.2f}' for v in sp['per_batch_teacher_acc'])})")
    out["wall_s"] = round(time.perf_counter() - begin, 1)
    print(f"\nwhole benchmark: {out['wall_s'] / 60:.1f} min")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
