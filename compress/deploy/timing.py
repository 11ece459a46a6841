"""How compress times a model - one protocol for the report's latency table, the export verdict (which reads the
table's cells) and `compress bench`, in every runtime: the files of a comparison take turns on the same input,
round by round, and each cell's figure is the median over the rounds of each round's fastest call. No compress
imports, so a runtime's child process (compress.deploy.openvino_child) runs the very same code."""

import statistics
import time
from dataclasses import dataclass

ROUNDS = 5  # interleaved rounds of a latency cell
LONGER_ROUNDS = 11  # the verdict's cell measured once more when int8 falls short of the speed-up asked for


@dataclass(frozen=True)
class Protocol:
    """How a latency cell is measured: `warmup` untimed calls of each file, then `rounds` rounds in which each
    file runs for about `round_s` seconds (3 to `most` calls) in turn, the order rotating by one file a round; the
    figure is the median over the rounds of each round's fastest call."""

    rounds: int = ROUNDS
    round_s: float = 0.05
    most: int = 30
    warmup: int = 5


def compare_latency(models, x, rounds=5, budget_s=0.25, warmup=2, stop=None, most=50):
    """{name: {"ms", "round_ms", "median_ms", "min_ms", "runs"}} for several models on the same input, measured
    interleaved: each round times every model in turn, so a busy neighbour slows them alike, and the order rotates
    by one model a round, so each is first, in the middle and last alike (reversing the order every other round
    kept the middle one of three in the middle: the QAT int8 file read 1.15x its op-for-op identical PTQ file at
    batch 64 and 0.86x at batch 1, median of 6 exports; rotated, 1.00x and 1.02x). `round_ms` holds each
    round's fastest run and `ms` their median - the protocol's figure: within a round other processes only add
    time, and the median over rounds ignores one lucky round (three tables of the same int8 file on a loaded
    2-core machine: 1.87-1.88 ms this way, 2.00-2.15 ms as the median of every run, which their bursts decide);
    `median_ms` is the median of every run. Each round runs a model for about `budget_s` seconds (3 to `most`
    runs), so a turn's first runs, slowed by whatever ran before, are not its figure. Sessions should stop their
    threads spinning between calls (compress.deploy.onnx_model does): a session that keeps them spinning slows
    the next one's whole turn."""
    names = list(models)
    samples = {n: [[] for _ in range(rounds)] for n in names}
    per_run = {}
    for n in names:
        for _ in range(warmup):
            models[n](x)
        start = time.perf_counter()
        models[n](x)
        per_run[n] = max(time.perf_counter() - start, 1e-6)
    for r in range(rounds):
        if stop:
            stop()
        for n in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(max(3, min(most, int(budget_s / per_run[n])))):
                start = time.perf_counter()
                models[n](x)
                samples[n][r].append((time.perf_counter() - start) * 1000.0)
    out = {}
    for n, per_round in samples.items():
        every, fastest = [t for one in per_round for t in one], [min(one) for one in per_round]
        out[n] = {"ms": statistics.median(fastest), "round_ms": [round(t, 4) for t in fastest],
                  "median_ms": statistics.median(every), "min_ms": min(every), "runs": len(every)}
    return out


def measure_cells(session, paths, x, batch_sizes, threads, protocol=Protocol(), stop=None):
    """{name: [cell, ...]} for files {name: path}: one cell per thread count x batch size, every file timed in
    it by `protocol`, interleaved; `session(path, threads)` opens a file in the runtime (a callable taking a
    batch), `x` holds at least max(batch_sizes) inputs (a batch of b is its first b)."""
    tables = {name: [] for name in paths}
    for t in threads:
        models = {name: session(path, t) for name, path in paths.items()}
        for b in batch_sizes:
            if stop:
                stop()
            times = compare_latency(models, x[:b], rounds=protocol.rounds, budget_s=protocol.round_s,
                                    warmup=protocol.warmup, stop=stop, most=protocol.most)
            for name, got in times.items():
                tables[name].append(cell(b, t, got))
    return tables


def cell(batch, threads, times):
    """A latency cell as export.json and `compress bench --json` write it (compress.deploy.export_report's
    LatencyCell)."""
    ms = times["ms"]
    return {"batch": batch, "threads": threads, "ms": round(ms, 4), "images_per_s": round(batch * 1000.0 / ms, 1),
            "round_ms": times["round_ms"], "median_ms": round(times["median_ms"], 4),
            "min_ms": round(times["min_ms"], 4), "runs": times["runs"]}


FEWER_THREADS = 1.1  # a file is said to run faster on fewer threads only when at least this much faster there


def fewer_threads(cells):
    """[(batch, threads, ms, most_threads, most_ms)] for each batch size at which one file's cells
    ({"batch", "threads", "ms"}) show it at least FEWER_THREADS times faster on fewer threads than on the most
    measured - a small int8 model at batch 1, whose layers are too little work to split."""
    by_batch = {}
    for c in cells:
        by_batch.setdefault(c["batch"], {})[c["threads"]] = c["ms"]
    found = []
    for batch, by_threads in sorted(by_batch.items()):
        most = max(by_threads)
        ms, threads = min((ms, t) for t, ms in by_threads.items())
        if threads < most and ms * FEWER_THREADS <= by_threads[most]:
            found.append((batch, threads, ms, most, by_threads[most]))
    return found


def median_ms(model, x, repeats=30, warmup=5):
    """Median milliseconds of `model(x)` over `repeats` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        model(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x)
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def threads_text(n):
    """'1 thread', '16 threads'."""
    return f"{n} thread{'s' if n != 1 else ''}"


def speedup_text(ratio):
    """'2.45x faster' or '1.33x slower' (never '0.75x faster')."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
