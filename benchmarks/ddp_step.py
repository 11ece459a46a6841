"""A torchrun worker for bench_train.py: each stage's model (teacher resnet14, student compact_cnn, the student
prepared for QAT) trained for N steps under DDP with gradient all-reduce, and N steps without it
(`no_sync`), same batch; prints JSON [{model, sync_ms, no_sync_ms, share}] on rank 0.

    torchrun --standalone --nproc_per_node 2 benchmarks/ddp_step.py --steps 40
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as tdist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compress.models.registry import build_model  # noqa: E402
from compress.quant import fx  # noqa: E402


def time_steps(ddp, optimizer, x, y, steps, sync):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        if sync:
            F.cross_entropy(ddp(x), y).backward()
        else:
            with ddp.no_sync():
                F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    tdist.barrier()
    return statistics.median(times[3:]) * 1000


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="per process (global 64 over 2)")
    args = parser.parse_args()
    tdist.init_process_group("gloo")
    torch.manual_seed(0)
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    rows = []
    for label, name, qat in (("teacher resnet14", "resnet14", False), ("student compact_cnn", "compact_cnn", False),
                             ("qat compact_cnn", "compact_cnn", True)):
        model = build_model(name, (1, 28, 28), 10)
        inputs = x
        if qat:
            model = fx.prepare(model, x[:2])
        else:  # the teacher and distill stages train in channels-last; QAT in the default layout
            model = model.to(memory_format=torch.channels_last)
            inputs = x.contiguous(memory_format=torch.channels_last)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        sync, no_sync = [], []
        for _ in range(3):  # interleaved
            sync.append(time_steps(ddp, optimizer, inputs, y, args.steps // 3, True))
            no_sync.append(time_steps(ddp, optimizer, inputs, y, args.steps // 3, False))
        s, n = statistics.median(sync), statistics.median(no_sync)
        rows.append({"model": label, "sync_ms": round(s, 2), "no_sync_ms": round(n, 2),
                     "share": round(max(0.0, (s - n) / s), 3)})
    if tdist.get_rank() == 0:
        print(json.dumps(rows))
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
