"""Fault injection for the crash tests, from the outside: the training loop has no test hooks.

    COMPRESS_FAULT=stage:epoch:step[:kill|nan|perturb|sigint|sighup|sigterm-group[:rank]] python tests/faults.py run ...

runs `compress` with `compress.training.loop.train_one_epoch` wrapped so that, in `stage` (its session name,
e.g. "teacher" or "distill baseline"; 0-based epoch and step): `kill` SIGKILLs this process right after that
step's optimizer update (a real kill -9 at a reproducible moment), `nan` makes that step's loss NaN, `perturb`
nudges this process's copy of the first parameter after that step's update (a replica that drifted from the
others), `sigint` sends this process SIGINT right after that step's update (Ctrl-C at a reproducible moment:
the real signal, through the real handler), `sighup` likewise SIGHUP (the terminal or ssh session closed),
`sigterm-group` SIGTERM to the whole process group, DataLoader workers included, as `timeout`, a batch scheduler
or a closing terminal send it (the process first becomes the leader of a group of its own, so nothing else is
hit).
With `rank`, only that rank is hit; under torchrun only the first attempt of the group is (a restarted group runs
clean). The script also works as torchrun's worker script.

    COMPRESS_FAULT=store:N python tests/faults.py run ...

SIGKILLs the process right after the teacher-output store wrote its N-th chunk of this run (a kill -9 in the
middle of building the store).
"""

import os
import signal
import sys
import time

# Run as a script (or as torchrun's worker script), this file's folder comes first on sys.path, and tests/stages/
# (the stage modules' tests) would stand in for the stages package: import compress and stages as installed.
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]

import torch  # noqa: E402

import compress.training.loop as loop  # noqa: E402


def install_store_fault(count):
    import compress.distill.store as store

    original, written = store.TeacherOutputStore._write_chunk, []

    def write_chunk(self, c, tensors):
        original(self, c, tensors)
        written.append(c)
        if len(written) == count:
            os.kill(os.getpid(), signal.SIGKILL)

    store.TeacherOutputStore._write_chunk = write_chunk


def install(spec):
    if spec.startswith("store:"):
        return install_store_fault(int(spec.split(":")[1]))
    parts = spec.split(":")
    stage, epoch, step = parts[0], int(parts[1]), int(parts[2])
    kind = parts[3] if len(parts) > 3 else "kill"
    rank = parts[4] if len(parts) > 4 else None
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if kind == "sigterm-group":
        os.setsid()  # a group of its own: the workers it forks join it, pytest does not
    original = loop.train_one_epoch

    def train_one_epoch(model, loss_fn, optimizer, loader, schedule, at_epoch, session):
        if session.name != stage or at_epoch != epoch:
            return original(model, loss_fn, optimizer, loader, schedule, at_epoch, session)
        position = {"step": session.resume.step if at_epoch == session.resume.epoch else 0}

        def faulty_loss(batch, global_step):
            loss, terms = loss_fn(batch, global_step)
            if kind == "nan" and position["step"] == step:
                loss = loss * torch.tensor(float("nan"))
            return loss, terms

        step_update = optimizer.step

        def faulty_step(*args, **kwargs):
            out = step_update(*args, **kwargs)
            if position["step"] == step:
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "sigint":
                    os.kill(os.getpid(), signal.SIGINT)
                if kind == "sighup":
                    os.kill(os.getpid(), signal.SIGHUP)
                if kind == "sigterm-group":
                    os.killpg(0, signal.SIGTERM)
                    time.sleep(1)  # the workers have taken the signal (or died of it) before the step ends
                if kind == "perturb":
                    with torch.no_grad():
                        next(model.parameters()).add_(1e-3)
            position["step"] += 1
            return out

        optimizer.step = faulty_step
        try:
            return original(model, faulty_loss, optimizer, loader, schedule, at_epoch, session)
        finally:
            optimizer.step = step_update

    loop.train_one_epoch = train_one_epoch


if __name__ == "__main__":
    if os.environ.get("COMPRESS_FAULT"):
        install(os.environ["COMPRESS_FAULT"])
    from compress.cli import main

    main(sys.argv[1:])
