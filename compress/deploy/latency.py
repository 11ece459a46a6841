"""Timing ONNX files with onnxruntime: a latency table per batch size and thread count, and side-by-side
comparisons measured interleaved (a busy neighbour slows every model alike)."""

import numpy as np

from compress.cpus import usable_cpus
from compress.deploy.onnx_model import OnnxModel
from compress.deploy.timing import compare_latency, median_ms, speedup_text

__all__ = ["compare_latency", "latency_table", "latency_tables", "median_ms", "speedup_text"]


TABLE_ROUND_S = 0.05  # seconds a file runs in each of a table cell's 5 interleaved rounds (at most `repeats` runs)


def latency_table(path, batch_sizes=(1, 64), threads=None, repeats=30, warmup=5, stop=None, runtime="onnxruntime"):
    """[{batch, threads, ms, images_per_s}] for each batch size x thread count in `runtime`; `stop()` is called
    between cells (it raises to abandon the measurement)."""
    if runtime == "openvino":  # in a child process of its own (compress.deploy.openvino_child)
        from compress.deploy.openvino_child import request

        if stop:
            stop()
        return request({"do": "table", "path": str(path), "batch_sizes": list(batch_sizes),
                        "threads": list(threads or (1, usable_cpus())), "repeats": repeats, "warmup": warmup})
    return latency_tables({"file": path}, batch_sizes, threads, repeats, warmup, stop)["file"]


def latency_tables(paths, batch_sizes=(1, 64), threads=None, repeats=30, warmup=5, stop=None, runtime="onnxruntime"):
    """{name: latency_table rows} for several files {name: path}. In onnxruntime the files take turns in each
    cell (5 interleaved rounds of up to TABLE_ROUND_S seconds and `repeats` runs each; the median), so a busy
    machine slows them alike and the table's ratios hold (timed one after the other, the same PTQ and QAT files
    read 2.09 and 4.99 ms on a loaded machine); OpenVINO times each file in a child process of its own, one after
    the other."""
    if runtime != "onnxruntime":
        return {k: latency_table(p, batch_sizes, threads, repeats, warmup, stop, runtime) for k, p in paths.items()}
    threads = list(threads or (1, usable_cpus()))
    shape = OnnxModel(next(iter(paths.values())), require_metadata=False).input_shape
    tables = {k: [] for k in paths}
    for t in threads:
        models = {k: OnnxModel(p, threads=t, require_metadata=False) for k, p in paths.items()}
        for b in batch_sizes:
            if stop:
                stop()
            x = np.random.default_rng(0).standard_normal((b, *shape), dtype=np.float32)
            cell = ({k: median_ms(m, x, repeats, warmup) for k, m in models.items()} if len(models) == 1 else
                    {k: t["median_ms"] for k, t in compare_latency(models, x, rounds=5, budget_s=TABLE_ROUND_S,
                                                                   warmup=warmup, stop=stop, most=repeats).items()})
            for k, ms in cell.items():
                tables[k].append({"batch": b, "threads": t, "ms": round(ms, 4),
                                  "images_per_s": round(b * 1000.0 / ms, 1)})
    return tables
