"""Graceful stop: the first Ctrl-C, SIGTERM or SIGHUP (the terminal or ssh session closed) asks training to stop
after the current step; the loop writes the resume checkpoint and raises Interrupted. A second Ctrl-C stops at
once."""

import contextlib
import os
import signal

import torch

from compress.errors import Interrupted
from compress.torchrun import env_rank
from compress.training import distributed as dist

_requested = False


ACK = b"\nstopping at the next safe point (a training stage saves a checkpoint there; Ctrl-C again stops at once)\n"


def _handler(signum, frame):
    global _requested
    if _requested and signum == signal.SIGINT:
        raise KeyboardInterrupt
    if not _requested and signum == signal.SIGINT and env_rank() == 0:
        try:  # the stop takes a step or a checkpoint's write: say it was heard (os.write: safe in a handler)
            os.write(2, ACK)
        except OSError:
            pass
    _requested = True


@contextlib.contextmanager
def graceful_stop():
    """Install the handlers for the duration of the pipeline (main thread only), then restore them."""
    global _requested
    _requested = False
    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])):
            previous[sig] = signal.signal(sig, _handler)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            # a torchrun worker's SIGTERM comes from its agent stopping the group as this process says why it
            # stopped and exits: it keeps the flag-only handler, so the line is said and the exit code is its own
            if not (sig == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ):
                signal.signal(sig, old)


def local_request():
    """This process was asked to stop (not yet agreed with the other ranks)."""
    return _requested


def requested(env):
    """True on every rank if any rank was asked to stop (all ranks must stop at the same step)."""
    if not env.distributed:
        return _requested
    flag = torch.tensor([1 if _requested else 0], dtype=torch.long)
    return bool(dist.all_reduce(env, flag, op="max").item())


def stop_if_asked(where, env=None, what="continue"):
    """Raise Interrupted ("interrupted <where>; rerun the same command to <what>") if a stop was asked for:
    on every rank together when `env` is given (all ranks must agree), else for this process alone (rank-0
    work such as the export stage or timing int8 candidates)."""
    asked = requested(env) if env is not None else _requested
    if not asked:
        return
    error = Interrupted(f"interrupted {where}; rerun the same command to {what}")
    if env is not None:
        dist.raise_on_main(env, error)
    raise error
