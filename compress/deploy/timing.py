"""Timing any callable model (an onnxruntime session or an OpenVINO request): the median of repeated calls, and
several models compared interleaved. No compress imports, so the OpenVINO child process can use it too."""

import statistics
import time


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


def compare_latency(models, x, rounds=5, budget_s=0.25, warmup=2, stop=None, most=50):
    """{name: {"min_ms", "median_ms", "runs"}} for several onnxruntime models on the same input, measured
    interleaved: each round times every model in turn (alternating the order), so a busy neighbour slows
    them alike. The minimum is the estimate least disturbed by other processes (noise only adds time);
    each round runs a model for about `budget_s` seconds (3 to `most` runs). Rounds of a few runs would not do:
    the session timed before keeps its threads spinning for a while, and the next one's first runs share the
    cores with them (fp32 read 4.4 ms timed 6 runs a turn beside two int8 sessions, 1.9 ms alone)."""
    names = list(models)
    samples = {n: [] for n in names}
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
        for n in (names if r % 2 == 0 else names[::-1]):
            for _ in range(max(3, min(most, int(budget_s / per_run[n])))):
                start = time.perf_counter()
                models[n](x)
                samples[n].append((time.perf_counter() - start) * 1000.0)
    return {n: {"min_ms": min(v), "median_ms": statistics.median(v), "runs": len(v)} for n, v in samples.items()}


def speedup_text(ratio):
    """'2.45x faster' or '1.33x slower' (never '0.75x faster')."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
