"""Graceful stop: the first Ctrl-C or SIGTERM asks training to stop after the current step; the loop writes
the resume checkpoint and raises Interrupted. A second Ctrl-C stops at once."""

import contextlib
import signal

import torch

from compress import dist

_requested = False


def _handler(signum, frame):
    global _requested
    if _requested and signum == signal.SIGINT:
        raise KeyboardInterrupt
    _requested = True


@contextlib.contextmanager
def graceful_stop():
    """Install the handlers for the duration of the pipeline (main thread only), then restore them."""
    global _requested
    _requested = False
    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _handler)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
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
