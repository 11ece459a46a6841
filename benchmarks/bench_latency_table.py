"""Does the report's latency table agree with the verdict's timing, and with each file timed alone? For each
--variant of the code, `compress run --stages export --force` on a copy of a finished run directory (interleaved,
--rounds rounds), then from its export.json: the table's fp32 and int8 cells at the verdict's batch and thread
count against the verdict's own interleaved medians (speed gate) - and, once per round, each file timed alone in
one onnxruntime session (the median of 200 runs), what a deployment running one model sees.

    git archive <commit> | tar -x -C /tmp/old_table
    python benchmarks/bench_latency_table.py --run artifacts/default --variant before=/tmp/old_table \\
        --variant after=. --rounds 2 --work /tmp/latency_table --json benchmarks/results/latency_table.json
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np


def export_once(code, run):
    cmd = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); from compress.cli import main; "
           "main(sys.argv[1:])", os.path.abspath(code), "run", "--run-dir", run, "--stages", "export", "--force"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{code}: exit {done.returncode}\n{done.stderr[-2000:]}")
    seconds = time.perf_counter() - start
    with open(os.path.join(run, "export", "export.json")) as f:
        report = json.load(f)
    speed = report["speed"]
    cell = {k: next(c["ms"] for c in report["latency_ms"][k]
                    if (c["batch"], c["threads"]) == (speed["batch"], speed["threads"])) for k in ("fp32", "int8")}
    gate = speed["attempts"][-1]
    return {"seconds": round(seconds, 1), "table_fp32_ms": cell["fp32"], "table_int8_ms": cell["int8"],
            "gate_fp32_median_ms": gate["fp32_median_ms"], "gate_int8_median_ms": gate["int8_median_ms"],
            "batch": speed["batch"], "threads": speed["threads"]}


def alone(run, batch, threads):
    """Each file in one session of its own, nothing else running in this process: median of 200 runs."""
    import onnxruntime as ort

    out = {}
    for kind in ("fp32", "int8"):
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
        session = ort.InferenceSession(os.path.join(run, "export", f"model.{kind}.onnx"), options,
                                       providers=["CPUExecutionProvider"])
        inp = session.get_inputs()[0]
        x = np.random.default_rng(0).standard_normal((batch, *inp.shape[1:]), dtype=np.float32)
        for _ in range(20):
            session.run(None, {inp.name: x})
        times = []
        for _ in range(200):
            start = time.perf_counter()
            session.run(None, {inp.name: x})
            times.append((time.perf_counter() - start) * 1000)
        out[f"alone_{kind}_ms"] = round(statistics.median(times), 4)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a finished run directory (copied, never changed)")
    parser.add_argument("--variant", action="append", required=True, help="NAME=PATH of a copy of the code")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default="/tmp/latency_table")
    parser.add_argument("--json")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    rows = []
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            run = os.path.join(args.work, name)
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(args.run, run)
            row = {"round": r + 1, "variant": name, **export_once(variants[name], run)}
            row.update(alone(run, row["batch"], row["threads"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
