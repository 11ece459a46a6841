"""Which code keeps a gloo process group alive after destroy_process_group()? Each variant is a fresh 2-process
torchrun group; a worker counts its OS threads (/proc/self/task) after destroy_process_group() and gc. A group
that was really freed has joined its threads (two pt_gloo_runloop, one gloo_tcp_loop): only the main thread
is left.

    python benchmarks/probe_group_threads.py        # about 1 min

The finding it reproduces (BENCHMARKS.md, "Clean exits"): torch.distributed.nn.functional binds group.WORLD
as a default argument at import; DDP's constructor imports it (via torch._dynamo), so imported after
init_process_group it keeps the group, and its threads, alive until the process ends. Linux only.
"""

import gc
import os
import subprocess
import sys
import time
import warnings

VARIANTS = {
    "plain": "plain collectives, no DDP",
    "ddp": "DDP(model): one step, then deleted",
    "dynamo-after": "import torch._dynamo after init_process_group",
    "dynamo-before": "import torch._dynamo before init_process_group",
    "ddp-nn-first": "DDP as above, torch.distributed.nn.functional imported first (compress's fix)",
}


def worker(variant):
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    if variant == "dynamo-before":
        import torch._dynamo  # noqa: F401
    if variant == "ddp-nn-first":
        import torch.distributed.nn.functional  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    if variant in ("ddp", "ddp-nn-first"):
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        ddp(torch.randn(3, 4)).sum().backward()
        del ddp
    if variant == "dynamo-after":
        import torch._dynamo  # noqa: F401
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
    time.sleep(0.3)
    if os.environ["RANK"] == "0":
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in sorted(os.listdir("/proc/self/task"))]
        print(f"THREADS {len(names)} {' '.join(names)}", flush=True)


def main():
    print(f"{'variant':<80} threads after destroy_process_group()")
    for variant, description in VARIANTS.items():
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "--max-restarts", "0", __file__, variant], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("THREADS ")), None)
        result = line.split(" ", 2)[1:] if line else ["failed", proc.stderr.strip().splitlines()[-1:]]
        print(f"{description:<80} {result[0]} ({result[1]})", flush=True)


if __name__ == "__main__":
    if "RANK" in os.environ:
        worker(sys.argv[1])
    else:
        main()
