"""Where a QAT training step's time goes, on this CPU: the qat stage's step (fake-quant forward and backward, plus
the frozen float model's forward for its distillation term) against variants that leave one part out, interleaved
over rounds so a busy neighbour slows every variant alike.

    python benchmarks/bench_qat.py --model resnet18_half --size 112            # ~2 min
    python benchmarks/bench_qat.py --model torchvision:mobilenet_v2 --size 64 --profile

Variants (batch --batch, --threads threads, fp32 as the stage trains):
    float          the float model's training step (what QAT is compared with)
    qat            the stage's step: fake-quant model + KD from the frozen float copy, observers learning
    qat_frozen     the same after the observers and BN statistics are frozen (epochs after qat.freeze_*_after)
    qat_no_kd      without the distillation term (qat.kd_weight 0): no float forward
    qat_no_kd_frozen
--profile prints torch.profiler's top operators of the `qat` step.
"""

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

from compress.distill.logit_losses import hinton
from compress.models.registry import build_model
from compress.quant import fx


def step_fn(model, reference, optimizer, x, y, ref_bf16=False):
    def step():
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if reference is not None:
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=ref_bf16):
                target = reference(x).float()
            loss = loss + hinton(logits, target, 1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def variants(name, size, batch, classes=10):
    torch.manual_seed(0)
    shape = (3, size, size)
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    float_model = build_model(name, shape, classes)
    reference = copy.deepcopy(float_model).eval().requires_grad_(False)
    out = {"float": step_fn(float_model, None, torch.optim.SGD(float_model.parameters(), lr=1e-3), x, y)}
    for kd in (True, False):
        for frozen in (False, True):
            prepared = fx.prepare(copy.deepcopy(float_model), x[:2], "x86", "full", True)
            if frozen:
                fx.freeze_observers(prepared)
                fx.freeze_bn(prepared)
            key = "qat" + ("" if kd else "_no_kd") + ("_frozen" if frozen else "")
            out[key] = step_fn(prepared, reference if kd else None, torch.optim.Adam(prepared.parameters(), 1e-4),
                               x, y)
    # channels-last memory layout for the fake-quant model and its input; the float reference in bf16 autocast
    cl = torch.channels_last
    prepared = fx.prepare(copy.deepcopy(float_model), x[:2], "x86", "full", True).to(memory_format=cl)
    ref_cl = copy.deepcopy(reference).to(memory_format=cl)
    out["qat_channels_last"] = step_fn(prepared, ref_cl, torch.optim.Adam(prepared.parameters(), 1e-4),
                                       x.contiguous(memory_format=cl), y)
    out["qat_channels_last_ref_bf16"] = step_fn(prepared, ref_cl, torch.optim.Adam(prepared.parameters(), 1e-4),
                                                x.contiguous(memory_format=cl), y, ref_bf16=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18_half")
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    steps = variants(args.model, args.size, args.batch)
    for fn in steps.values():
        fn(), fn()  # warm-up: oneDNN primitive creation, first allocations
    times = {k: [] for k in steps}
    for r in range(args.rounds):
        for k in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[k]()
            times[k].append((time.perf_counter() - start) / args.steps)
    rows = {k: {"ms_per_step": round(1000 * statistics.median(v), 1),
                "images_per_s": round(args.batch / statistics.median(v), 1)} for k, v in times.items()}
    print(f"{args.model} at {args.size}x{args.size}, batch {args.batch}, {args.threads} threads, median of "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    print("| variant | ms per step | images/s | vs float |\n|---|---:|---:|---:|")
    for k, row in rows.items():
        print(f"| {k} | {row['ms_per_step']} | {row['images_per_s']} | "
              f"{row['ms_per_step'] / rows['float']['ms_per_step']:.2f}x |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                steps["qat"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
