"""Training throughput: compress's training loop against the textbook PyTorch loop, in fp32 and in bf16
autocast, with the FLOP/s they achieve against what this CPU can do; and 1 vs 2 processes.

Part 1 (side by side, one process, interleaved rounds; per model and precision): the same model, initial
weights, optimizer, batch, data and torch threads, trained for the same number of steps by

  - compress: `compress.training.loop.train_one_epoch` with the stage's Session (channels-last, the precision,
    per-step LR schedule, RNG re-seeding, the per-step stop/NaN agreement), fed by compress's loader;
  - the textbook loop: the same tensors through a plain `DataLoader`, `zero_grad / cross_entropy / backward /
    step`, channels-last and the same autocast (so the columns differ by the loop, not the layout or the
    precision).

FLOPs per training image are counted with torch.utils.flop_counter.FlopCounterMode on one forward+backward
(convolutions and matrix products; element-wise work is not counted, so utilisation is a lower bound). Peak =
cores x clock x FLOPs per cycle per core: the clock is what /proc/cpuinfo reports ('cpu MHz', the nominal clock
of a virtual machine; turbo may be higher), FLOPs per cycle from the CPU's flags - fp32: 2 AVX-512 FMA units x 16
lanes x 2 = 64 (AVX2: 32); bf16: AMX (amx_bf16) 1,024 per the vendor's TMUL rate, else AVX512-BF16 2 x 16 pairs
x 2 x 2 = 128; AMD's Zen 4 runs 512-bit work on 256-bit units: half of each.

Part 2 (1 vs 2 processes): `compress run --stages teacher,distill,qat` with --nproc-per-node 1 and 2 on the same
config and global batch: wall time and images/s per stage from the manifest; and, in a 2-process torchrun
worker (`ddp_step.py`), each stage's model timed with DDP's gradient all-reduce and without (`no_sync`), giving
the share of a step spent communicating.

    python benchmarks/bench_train.py --skip-processes          # the FLOP table: resnet14, resnet20, compact_cnn,
                                                               # mobilenet_v2 at 64 px; fp32 and bf16
    python benchmarks/bench_train.py --models resnet20 --precisions bf16 --steps 40 --skip-processes
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

from compress.data.imageset import ImageSet, TensorImages  # noqa: E402
from compress.data.sampling import EpochBatches  # noqa: E402
from compress.models.registry import build_model  # noqa: E402
from compress.training.loop import Session, train_one_epoch  # noqa: E402
from compress.training.precision import Precision  # noqa: E402
from compress.training.schedule import Schedule  # noqa: E402

SIZES = {"mobilenet_v2": 64, "resnet18": 64}  # the others at 32x32


def cpu_peak():
    """{"cores", "ghz", "fp32", "bf16"}: peak GFLOP/s of this machine (see the module docstring)."""
    info = open("/proc/cpuinfo").read()
    flags = next(line for line in info.splitlines() if line.startswith("flags")).split()
    mhz = float(next(line for line in info.splitlines() if line.startswith("cpu MHz")).split(":")[1])
    amd = "AuthenticAMD" in info
    fp32 = (64 if "avx512f" in flags else 32) // (2 if amd else 1)
    bf16 = 1024 if "amx_bf16" in flags else (128 // (2 if amd else 1) if "avx512_bf16" in flags else fp32)
    cores = os.cpu_count() or 1
    return {"cores": cores, "ghz": round(mhz / 1000, 3), "flops_per_cycle": {"fp32": fp32, "bf16": bf16},
            "fp32": cores * mhz / 1000 * fp32, "bf16": cores * mhz / 1000 * bf16}


def flops_per_image(name, size, batch=16):
    """Forward + backward FLOPs of one training image (counted on a batch, divided)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(name, (3, size, size), 10)
    x = torch.randn(batch, 3, size, size)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), torch.zeros(batch, dtype=torch.long)).backward()
    return counter.get_total_flops() / batch


def images(name, count=2048, seed=0):
    size = SIZES.get(name.split(":")[-1], 64 if ":" in name else 32)  # torchvision models at 64x64
    g = torch.Generator().manual_seed(seed)
    data = ImageSet(torch.randint(0, 10, (count,), generator=g), (3, size, size),
                    TensorImages(torch.randint(0, 256, (count, 3, size, size), generator=g, dtype=torch.uint8)))
    data.normalise_with((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return data


def precision_of(name):
    return Precision({"fp32": None, "bf16": torch.bfloat16}[name], "cpu", torch.channels_last)


def compress_loop(model, data, steps, batch, precision, epoch):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sampler = EpochBatches(len(data), batch, seed=epoch)
    sampler.set_epoch(epoch)
    precision = precision.place([model], data.batch([0]).x)
    session = Session(name="teacher", precision=precision, seed_key=(0, "teacher"))

    def loss_fn(b, step):
        return F.cross_entropy(model(b.x), b.y), {}

    start = time.perf_counter()
    sums = train_one_epoch(model, loss_fn, optimizer, _Timed(data, sampler, steps, epoch),
                           Schedule("cosine", 0.05, 1, steps, warmup_epochs=0.1), epoch, session)
    return sums["images"] / (time.perf_counter() - start)


class _Timed:
    """compress's batches of one epoch, made as the DataLoader makes them (in the loop's time)."""

    def __init__(self, data, sampler, steps, epoch):
        self.data, self.sampler, self.steps, self.epoch = data, sampler, steps, epoch

    def __iter__(self):
        for step, (_, idx) in enumerate(self.sampler):
            if step >= self.steps:
                return
            yield self.data[(self.epoch, idx)]


def textbook_loop(model, tensors, steps, batch, precision):
    model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*tensors), batch_size=batch, shuffle=True)
    model.train()
    count, start = 0, time.perf_counter()
    for step, (x, y) in enumerate(loader):
        if step >= steps:
            break
        optimizer.zero_grad()
        with precision.autocast():
            loss = F.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
        loss.backward()
        optimizer.step()
        loss.item()
        count += len(y)
    return count / (time.perf_counter() - start)


def side_by_side(name, precisions, steps, rounds, batch):
    data = images(name)
    everything = data.batch(range(len(data)))
    tensors = (everything.x, everything.y)
    torch.manual_seed(0)
    initial = build_model(name, data.image_shape, 10).state_dict()
    cells = [(loop, p) for p in precisions for loop in ("compress", "textbook")]
    results = {cell: [] for cell in cells}
    for loop, p in cells:  # untimed: oneDNN builds its kernels for each layout and precision on first use
        model = build_model(name, data.image_shape, 10)
        (compress_loop(model, data, 3, batch, precision_of(p), 99) if loop == "compress"
         else textbook_loop(model, tensors, 3, batch, precision_of(p)))
    for r in range(rounds):
        for loop, p in (cells if r % 2 == 0 else cells[::-1]):
            model = build_model(name, data.image_shape, 10)
            model.load_state_dict(initial)
            rate = (compress_loop(model, data, steps, batch, precision_of(p), r) if loop == "compress"
                    else textbook_loop(model, tensors, steps, batch, precision_of(p)))
            results[(loop, p)].append(rate)
            print(f"  {name} round {r + 1} {loop:9s} {p}: {rate:8.1f} images/s", flush=True)
    flops = flops_per_image(name, data.image_shape[-1])
    out = {"model": name, "size": data.image_shape[-1], "steps": steps, "batch": batch, "flops_per_image": flops,
           "rounds": {f"{loop} {p}": [round(x, 1) for x in v] for (loop, p), v in results.items()}}
    for (loop, p), v in results.items():
        out[f"{loop}_{p}"] = round(statistics.median(v), 1)
    return out


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
    parser.add_argument("--models", default="resnet14,resnet20,compact_cnn,mobilenet_v2")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=30, help="training steps per loop and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--config", default=None, help="config for part 2 (default: the built-in default)")
    parser.add_argument("--set", action="append", default=[], help="config override for part 2 (repeatable)")
    parser.add_argument("--skip-loops", action="store_true")
    parser.add_argument("--skip-processes", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results = {"command": "python benchmarks/bench_train.py " + " ".join(sys.argv[1:]), "peak": cpu_peak(),
               "loops": [], "processes": None, "comm": None}
    precisions = args.precisions.split(",")
    if not args.skip_loops:
        for name in args.models.split(","):
            print(f"{name}: compress loop vs textbook loop, {args.steps} steps x {args.rounds} rounds", flush=True)
            results["loops"].append(side_by_side(name, precisions, args.steps, args.rounds, args.batch))
    if not args.skip_processes:
        print("1 vs 2 processes (compress run, same global batch)", flush=True)
        results["processes"] = processes(args.config, args.set)
        print("communication share of a DDP step (2 processes, gloo)", flush=True)
        results["comm"] = comm_share(40)
    peak = results["peak"]
    print(f"\npeak: {peak['cores']} cores x {peak['ghz']} GHz x {peak['flops_per_cycle']} FLOPs/cycle = "
          f"{peak['fp32']:.0f} GFLOP/s fp32, {peak['bf16']:.0f} GFLOP/s bf16")
    print("\n| model | input | GFLOP per image (fwd+bwd) | precision | compress images/s | textbook images/s | "
          "compress / textbook | achieved GFLOP/s | % of peak |\n|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in results["loops"]:
        for p in precisions:
            achieved = r["flops_per_image"] * r[f"compress_{p}"] / 1e9
            print(f"| {r['model']} | {r['size']}x{r['size']} | {r['flops_per_image'] / 1e9:.4f} | {p} | "
                  f"{r[f'compress_{p}']:.0f} | {r[f'textbook_{p}']:.0f} | "
                  f"{r[f'compress_{p}'] / r[f'textbook_{p}']:.2f}x | {achieved:.1f} | "
                  f"{100 * achieved / peak[p]:.1f}% |")
        if "fp32" in precisions and "bf16" in precisions:
            print(f"|  |  |  | bf16 / fp32 | {r['compress_bf16'] / r['compress_fp32']:.2f}x | "
                  f"{r['textbook_bf16'] / r['textbook_fp32']:.2f}x |  |  |  |")
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
