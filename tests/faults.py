"""Fault injection for the crash tests, from the outside: the training loop has no test hooks.

    COMPRESS_FAULT=stage:epoch:step[:kill|nan[:rank]] python tests/faults.py run ...

runs `compress` with `compress.train.train_one_epoch` wrapped so that, in `stage` (0-based epoch and step):
`kill` SIGKILLs this process right after that step's optimizer update (a real kill -9 at a reproducible
moment), `nan` makes that step's loss NaN. With `rank`, only that rank is hit; under torchrun only the first
attempt of the group is (a restarted group runs clean). The script also works as torchrun's worker script.
"""

import os
import signal
import sys

import torch

import compress.train


def install(spec):
    parts = spec.split(":")
    stage, epoch, step = parts[0], int(parts[1]), int(parts[2])
    kind = parts[3] if len(parts) > 3 else "kill"
    rank = parts[4] if len(parts) > 4 else None
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    original = compress.train.train_one_epoch

    def train_one_epoch(model, loader, optimizer, loss_fn, **kw):
        if kw["name"] != stage or kw["epoch"] != epoch:
            return original(model, loader, optimizer, loss_fn, **kw)
        position = {"step": kw.get("start_step", 0)}

        def faulty_loss(batch):
            loss, parts = loss_fn(batch)
            if kind == "nan" and position["step"] == step:
                loss = loss * torch.tensor(float("nan"))
            return loss, parts

        step_update = optimizer.step

        def faulty_step(*args, **kwargs):
            out = step_update(*args, **kwargs)
            if kind == "kill" and position["step"] == step:
                os.kill(os.getpid(), signal.SIGKILL)
            position["step"] += 1
            return out

        optimizer.step = faulty_step
        try:
            return original(model, loader, optimizer, faulty_loss, **kw)
        finally:
            optimizer.step = step_update

    compress.train.train_one_epoch = train_one_epoch


if __name__ == "__main__":
    if os.environ.get("COMPRESS_FAULT"):
        install(os.environ["COMPRESS_FAULT"])
    from compress.cli import main

    main(sys.argv[1:])
