"""Which samples each process trains and evaluates on, batch by batch, reproducibly from (seed, epoch)."""

import os
import shutil
import signal
import threading

import torch
from torch.utils.data import DataLoader, Sampler

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class EpochBatches(Sampler):
    """This rank's batches of one epoch, as `(epoch, indices)` requests.

    The order is a shuffle seeded by (seed + epoch), the same on every rank, padded to a multiple of the
    world size and dealt out every world-th sample, as DistributedSampler does, so all ranks take the same
    number of steps. A last batch of a single sample is merged into the one before it: batch-norm cannot
    train on one image ("Expected more than 1 value per channel"), and merging keeps every image in the epoch
    where dropping it would skip one image every epoch. `set_epoch(epoch, skip)` picks the epoch and, to
    resume in the middle of one, skips its first `skip` batches. The epoch travels with each request, so a
    dataset in a worker process knows it too."""

    def __init__(self, size, batch_size, rank=0, world=1, seed=0):
        self.size, self.batch_size, self.rank, self.world, self.seed = size, batch_size, rank, world, seed
        self.epoch, self.skip = 0, 0

    @property
    def per_rank(self):
        return -(-self.size // self.world)

    @property
    def batches_per_epoch(self):
        batches = -(-self.per_rank // self.batch_size)
        return batches - 1 if batches > 1 and self.per_rank % self.batch_size == 1 else batches

    def set_epoch(self, epoch, skip=0):
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        total = self.per_rank * self.world
        order += order[:total - self.size]
        mine = order[self.rank:total:self.world]
        last = self.batches_per_epoch - 1
        for b in range(self.skip, self.batches_per_epoch):
            end = len(mine) if b == last else (b + 1) * self.batch_size
            yield self.epoch, mine[b * self.batch_size:end]

    def __len__(self):
        return max(0, self.batches_per_epoch - self.skip)


WORKER_GRACE_S = 2.0


def _leave_stop_signals_to_the_trainer(worker_id):
    """DataLoader workers leave Ctrl-C and SIGHUP to the training process, and take SIGTERM as "finish the batches
    asked for, then exit cleanly". `timeout`, batch schedulers and terminals signal the whole process group: a worker
    dying of the signal makes the training process fail ("DataLoader worker ... killed by signal") instead of
    stopping at its next step with a checkpoint. SIGTERM cannot simply be ignored: it is also how multiprocessing
    ends a process's workers when it exits."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit_soon if sig == signal.SIGTERM else signal.SIG_IGN)


def _exit_soon(signum, frame):
    timer = threading.Timer(WORKER_GRACE_S, _exit_now)
    timer.daemon = True
    timer.start()


def _exit_now():
    """Exit the worker from the timer's thread. os._exit skips the interpreter's exit handlers, one of which removes
    the worker's temporary folder (/tmp/pymp-*, holding the socket through which it shared tensors): remove it here.
    Only that: the other handlers join the worker's queue threads, which could wait on the training process."""
    from multiprocessing import process

    try:
        folder = process.current_process()._config.get("tempdir")  # where multiprocessing.util keeps it
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        os._exit(0)


def _loader(dataset, sampler, num_workers, pin_memory):
    return DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=pin_memory,
                      prefetch_factor=4 if num_workers else None,
                      worker_init_fn=_leave_stop_signals_to_the_trainer if num_workers else None)


def train_loader(dataset, batch_size, rank, world, seed, num_workers=0, pin_memory=False):
    """Shuffled, sharded over ranks; call `loader.sampler.set_epoch(epoch, skip)` before each epoch."""
    return _loader(dataset, EpochBatches(len(dataset), batch_size, rank, world, seed), num_workers, pin_memory)


def eval_loader(dataset, batch_size, rank, world, num_workers=0, pin_memory=False):
    """Each rank takes every world-th sample, without padding, so all-reduced counts are exact."""
    shard = list(range(rank, len(dataset), world))
    return _loader(dataset, [(None, shard[i:i + batch_size]) for i in range(0, len(shard), batch_size)],
                   num_workers, pin_memory)
