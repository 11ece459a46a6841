"""Latency tables: every file timed in every cell (batch size x thread count) by the one protocol of
compress.deploy.timing, in any registered runtime, on one kind of input - random 8-bit pixels normalised as the
file's own metadata says, which any deployment can make from the file alone. The report's table, the export
verdict (it reads the table's largest-batch cell on the most threads timed) and `compress bench` all come from
here, so a file timed by any of them is timed the same way."""

import functools
import logging

import numpy as np

from compress.cpus import usable_cpus
from compress.deploy.imageio import finite_list
from compress.deploy.onnx_model import batch_of, fixed_batch_error, metadata_of, read_onnx, refuse_control_flow
from compress.deploy.runtimes import FIRST, RUNTIMES
from compress.deploy.timing import LONGER_ROUNDS, ROUNDS, Protocol, compare_latency, median_ms, speedup_text

__all__ = ["compare_latency", "latency_table", "latency_tables", "median_ms", "speedup_text", "timing_input"]

log = logging.getLogger(__name__)


def default_threads():
    """One thread and every usable core: a deployment's two ends."""
    return sorted({1, usable_cpus()})


def protocol(repeats=30, warmup=5, rounds=ROUNDS):
    """The protocol with export.latency_repeats / `bench --repeats` as the most runs of a file a round."""
    return Protocol(rounds=rounds, most=repeats, warmup=warmup)


def timing_input(path, batch, seed=0):
    """`batch` inputs for the ONNX file at `path`: uniformly random 8-bit pixels in its input shape, scaled and
    normalised by its compress.mean/std (a file without them: pixels scaled to 0..1). Seeded: every timing of
    the file sees the same numbers."""
    proto = read_onnx(path)
    meta = metadata_of(proto)
    shape = meta.get("input_shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)):
        shape = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim[1:]]
    pixels = np.random.default_rng(seed).integers(0, 256, (batch, *shape)).astype(np.float32) / 255.0
    mean, std = meta.get("mean"), meta.get("std")
    if finite_list(mean) and finite_list(std) and len(mean) == len(std) == shape[0] and min(std) > 0:
        view = (1, shape[0]) + (1,) * (len(shape) - 1)
        pixels = (pixels - np.array(mean, np.float32).reshape(view)) / np.array(std, np.float32).reshape(view)
    return pixels


def latency_tables(paths, batch_sizes=(1, 64), threads=None, repeats=30, warmup=5, stop=None, runtime=FIRST,
                   rounds=ROUNDS):
    """{name: [cell, ...]} for files {name: path} in `runtime`: each thread count x batch size a cell, every file
    timed in it in turns (interleaved rounds, the median of the timed calls: a busy machine slows them alike),
    all on the first file's timing_input; `stop()` is called between cells and rounds (it raises to abandon)."""
    for path in paths.values():  # any runtime: a file it cannot time at these batch sizes, said before any timing
        proto = read_onnx(path)
        refuse_control_flow(path, proto)
        fixed = batch_of(path, proto)
        if fixed and any(b != fixed for b in batch_sizes):
            sizes = ", ".join(str(b) for b in batch_sizes)
            raise fixed_batch_error(path, fixed, f"it is timed at batch size{'s' if len(batch_sizes) > 1 else ''} "
                                                 f"{sizes}")
    x = timing_input(next(iter(paths.values())), max(batch_sizes))
    if threads and max(threads) > usable_cpus():
        _warn_oversubscribed(max(threads), usable_cpus())
    return RUNTIMES[runtime].measure(paths, x, batch_sizes, threads or default_threads(),
                                     protocol(repeats, warmup, rounds), stop)


@functools.lru_cache(maxsize=None)  # once a process
def _warn_oversubscribed(threads, cpus):
    log.warning("timing on %d threads with %d usable CPUs: those cells share cores, so they are slower than on a "
                "machine with %d; time the files on the target itself with compress bench", threads, cpus, threads)


def latency_table(path, batch_sizes=(1, 64), threads=None, repeats=30, warmup=5, stop=None, runtime=FIRST):
    """latency_tables for one file: its cells."""
    return latency_tables({"file": path}, batch_sizes, threads, repeats, warmup, stop, runtime)["file"]


def deciding_cell(cells):
    """(batch, threads) of the cell a verdict weighs: the largest batch on the most threads measured."""
    threads = max(c["threads"] for c in cells)
    return max(c["batch"] for c in cells if c["threads"] == threads), threads


def cell_ms(cells, batch, threads):
    """The milliseconds of the cell (batch, threads) in `cells`, or None where there is none."""
    return next((c["ms"] for c in cells if (c["batch"], c["threads"]) == (batch, threads)), None)


def remeasure(tables, paths, batch, threads, repeats=30, warmup=5, stop=None, runtime=FIRST):
    """The cell (batch, threads) of each of `paths` measured once more, LONGER_ROUNDS rounds, and put in
    `tables` in place of the first measurement (the longer one is the better estimate), so the table keeps
    showing the figures a verdict read."""
    again = latency_tables(paths, [batch], [threads], repeats, warmup, stop, runtime, rounds=LONGER_ROUNDS)
    for name, (new,) in again.items():
        tables[name] = [new if (c["batch"], c["threads"]) == (batch, threads) else c for c in tables[name]]
    return tables
