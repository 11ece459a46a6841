"""Training throughput: compress's teacher loop against the textbook PyTorch loop, and 1 vs 2 processes.

Part 1 (side by side, one process, interleaved rounds): the same model, initial weights, optimizer, global
batch, data and torch threads, trained for the same number of steps by

  - compress: `compress.train.train_one_epoch` fed by compress's loader (whole batches sliced from uint8
    tensors, per-step LR schedule, RNG re-seeding, the per-step stop/NaN agreement), as the teacher stage runs;
  - the textbook loop: `DataLoader(TensorDataset(x, y), batch_size, shuffle=True)` over the same normalised
    tensors, `zero_grad / cross_entropy / backward / step`;
  - the textbook loop with the model and each batch in channels-last, as compress trains: this column says how
    much of compress's lead is the memory layout (anyone can add it) and how much is the rest of the loop.

Part 2 (1 vs 2 processes): `compress run --stages teacher,distill,qat` with --nproc-per-node 1 and 2 on the same
config and global batch: wall time and images/s per stage from the manifest; and, in a 2-process torchrun
worker (`ddp_step.py`), each stage's model timed with DDP's gradient all-reduce and without (`no_sync`), giving
the share of a step spent communicating.

    python benchmarks/bench_train.py                                # resnet14 and resnet18, mnist5k; part 2
    python benchmarks/bench_train.py --models resnet14 --steps 40 --skip-processes
"""

import argparse
import json
import os
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
from compress.dist import DistEnv  # noqa: E402
from compress.models import build_model  # noqa: E402
from compress.train import Precision, Schedule, build_optimizer, train_one_epoch  # noqa: E402


class Steps(torch.utils.data.Sampler):
    """The first `steps` batches of compress's epoch sampler (so both loops run the same number of steps)."""

    def __init__(self, base, steps):
        self.base, self.steps = base, steps
        self.batches_per_epoch = min(steps, base.batches_per_epoch)

    def set_epoch(self, epoch, skip=0):
        self.base.set_epoch(epoch, skip)

    def __iter__(self):
        for i, request in enumerate(self.base):
            if i >= self.steps:
                return
            yield request

    def __len__(self):
        return self.batches_per_epoch


def compress_loop(model, data, cfg, steps, epoch):
    optimizer = build_optimizer(model.parameters(), cfg.teacher)
    loader = train_loader(data.train, cfg.teacher.batch_size, 0, 1, cfg.seed)
    loader = torch.utils.data.DataLoader(data.train, sampler=Steps(loader.sampler, steps), batch_size=None)
    loader.sampler.set_epoch(epoch)
    schedule = Schedule.from_config(cfg.teacher, loader.sampler.batches_per_epoch)
    precision = Precision.for_run(cfg.train.precision, torch.device("cpu")).place([model], data.train.batch([0]).x)

    def loss_fn(batch):
        return F.cross_entropy(model(batch.x), batch.y), {}

    start = time.perf_counter()
    sums = train_one_epoch(model, loader, optimizer, loss_fn, env=DistEnv(), epoch=epoch, schedule=schedule,
                           seed_key=(cfg.seed, "teacher", 0), name="teacher", precision=precision)
    return sums["images"] / (time.perf_counter() - start)


def textbook_loop(model, tensors, cfg, steps, memory_format=torch.contiguous_format):
    model.to(memory_format=memory_format)
    optimizer = build_optimizer(model.parameters(), cfg.teacher)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*tensors), batch_size=cfg.teacher.batch_size,
                                         shuffle=True)
    model.train()
    images, start = 0, time.perf_counter()
    for step, (x, y) in enumerate(loader):
        if step >= steps:
            break
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x.contiguous(memory_format=memory_format)), y)
        loss.backward()
        optimizer.step()
        loss.item()
        images += len(y)
    return images / (time.perf_counter() - start)


def side_by_side(name, cfg, steps, rounds):
    data = load_data(cfg.data, cfg.seed)
    everything = data.train.batch(range(len(data.train)))  # the same normalised tensors, un-augmented
    tensors = (everything.x, everything.y)
    torch.manual_seed(0)
    initial = build_model(name, data.input_shape, data.num_classes).state_dict()
    loops = ("compress", "textbook", "textbook_cl")
    results = {loop: [] for loop in loops}
    for r in range(rounds):
        for loop in (loops if r % 2 == 0 else loops[::-1]):
            model = build_model(name, data.input_shape, data.num_classes)
            model.load_state_dict(initial)
            rate = (compress_loop(model, data, cfg, steps, r) if loop == "compress"
                    else textbook_loop(model, tensors, cfg, steps,
                                       torch.channels_last if loop == "textbook_cl" else torch.contiguous_format))
            results[loop].append(rate)
            print(f"  {name} round {r + 1} {loop:11s} {rate:8.1f} images/s", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    return {"model": name, "steps": steps, "batch": cfg.teacher.batch_size, "threads": torch.get_num_threads(),
            "compress": round(med["compress"], 1), "textbook": round(med["textbook"], 1),
            "textbook_cl": round(med["textbook_cl"], 1), "ratio": round(med["compress"] / med["textbook"], 3),
            "ratio_cl": round(med["compress"] / med["textbook_cl"], 3),
            "rounds": {k: [round(x, 1) for x in v] for k, v in results.items()}}


def processes(config, overrides):
    """Wall time and images/s per stage for 1 and 2 processes (same config, same global batch)."""
    exe = os.path.join(os.path.dirname(sys.executable), "compress")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2):
            run = os.path.join(tmp, f"p{n}")
            cmd = [exe, "run", "--run-dir", run, "--stages", "teacher,distill,qat", "--nproc-per-node", str(n),
                   "--set", "train.progress=false", *[a for o in overrides for a in ("--set", o)]]
            cmd += ["-c", config] if config else []
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
            stages = json.load(open(os.path.join(run, "manifest.json")))["stages"]
            out[n] = {"wall_s": round(time.perf_counter() - start, 1),
                      **{s: {"seconds": stages[s]["seconds"], "images_per_s": stages[s]["metrics"]["images_per_s"],
                             "val_acc": stages[s]["metrics"].get("val_acc", stages[s]["metrics"].get("int8_acc"))}
                         for s in ("teacher", "distill", "qat")}}
            print(f"  {n} process(es): {out[n]}", flush=True)
    return out


def comm_share(steps):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "benchmarks", "ddp_step.py"), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet14,resnet18")
    parser.add_argument("--steps", type=int, default=60, help="training steps per loop and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--config", default=None, help="config for both parts (default: the built-in default)")
    parser.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    parser.add_argument("--skip-loops", action="store_true")
    parser.add_argument("--skip-processes", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    torch.set_num_threads(cfg.train.threads or os.cpu_count() or 1)
    results = {"loops": [], "processes": None, "comm": None}
    if not args.skip_loops:
        for name in args.models.split(","):
            print(f"{name}: compress loop vs textbook loop, {args.steps} steps x {args.rounds} rounds", flush=True)
            results["loops"].append(side_by_side(name, cfg, args.steps, args.rounds))
    if not args.skip_processes:
        print("1 vs 2 processes (compress run, same global batch)", flush=True)
        results["processes"] = processes(args.config, args.set)
        print("communication share of a DDP step (2 processes, gloo)", flush=True)
        results["comm"] = comm_share(40)
    print("\n| model | steps x batch | compress images/s | textbook images/s | ratio | textbook, channels-last | "
          "ratio |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in results["loops"]:
        print(f"| {r['model']} | {r['steps']} x {r['batch']} | {r['compress']:.0f} | {r['textbook']:.0f} | "
              f"{r['ratio']:.2f}x | {r['textbook_cl']:.0f} | {r['ratio_cl']:.2f}x |")
    if results["processes"]:
        print("\n| stage | 1 process: s, images/s | 2 processes: s, images/s |\n|---|---:|---:|")
        for s in ("teacher", "distill", "qat"):
            a, b = results["processes"][1][s], results["processes"][2][s]
            print(f"| {s} | {a['seconds']:.1f} s, {a['images_per_s']:.0f} | "
                  f"{b['seconds']:.1f} s, {b['images_per_s']:.0f} |")
        print(f"| whole run | {results['processes'][1]['wall_s']} s | {results['processes'][2]['wall_s']} s |")
    if results["comm"]:
        print("\n| model (2 processes) | step with all-reduce | step without (no_sync) | communication share |"
              "\n|---|---:|---:|---:|")
        for r in results["comm"]:
            print(f"| {r['model']} | {r['sync_ms']:.1f} ms | {r['no_sync_ms']:.1f} ms | {r['share']:.0%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
