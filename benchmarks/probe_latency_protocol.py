"""Why do the export table and `compress bench` disagree on a file's latency, and which timing protocol makes
repeated measurements of one file agree? A probe for BENCHMARKS.md ("Do the verdict, the report table and
`compress bench` agree?").

On a finished run's export files (fp32, QAT int8, PTQ int8: the set the export table times together), each of
--repeats rounds measures the batch-64 cell on every usable core once per protocol variant, once in this process
and once in a fresh process (as `compress bench` runs), the order alternating. A variant's spread is, per file,
the largest over the smallest of its 2 x repeats figures; a protocol fit for "verdict, table and bench agree
within 10 %" needs it under 1.10.

    python benchmarks/probe_latency_protocol.py --run /tmp/lat_photos --repeats 3 \\
        --json benchmarks/results/latency_protocol.json

Variants: the shipped protocol (5 rounds of up to 0.05 s a file), longer rounds (5 x 0.5 s), more rounds
(25 x 0.05 s), and the shipped protocol with onnxruntime's intra-op thread spinning off (the threads of the
file timed before stop at once instead of spinning on the cores the next file's calls need).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from compress.cpus import busy_elsewhere, usable_cpus
from compress.deploy.latency import timing_input
from compress.deploy.timing import Protocol, measure_cells

VARIANTS = {"shipped (5 x 0.05 s)": (Protocol(), True),
            "longer rounds (5 x 0.5 s)": (Protocol(round_s=0.5, most=1000), True),
            "more rounds (25 x 0.05 s)": (Protocol(rounds=25), True),
            "shipped, spinning off": (Protocol(), False)}
FILES = {"fp32": "model.fp32.onnx", "int8": "model.int8.onnx", "ptq": "model.ptq.onnx"}


def session_maker(spinning):
    import onnxruntime as ort

    def session(path, threads):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        s = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        name = s.get_inputs()[0].name
        return lambda x: s.run(None, {name: x})

    return session


def measure(run, variant, batch):
    paths = {k: os.path.join(run, "export", f) for k, f in FILES.items()}
    protocol, spinning = VARIANTS[variant]
    x = timing_input(paths["fp32"], batch)
    start = time.perf_counter()
    cells = measure_cells(session_maker(spinning), paths, x, [batch], [usable_cpus()], protocol)
    return {k: c[0]["ms"] for k, c in cells.items()}, time.perf_counter() - start


def in_child(run, variant, batch):
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--run", run, "--batch", str(batch)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a finished run directory (its export/ files are timed)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        ms, seconds = measure(args.run, args.child, args.batch)
        print(json.dumps({"ms": ms, "seconds": seconds}))
        return
    rows = []
    for r in range(args.repeats):
        order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for variant in order:
            for where in (("in process", "fresh process") if r % 2 == 0 else ("fresh process", "in process")):
                load = os.getloadavg()[0]
                busy = busy_elsewhere()
                if where == "in process":
                    ms, seconds = measure(args.run, variant, args.batch)
                else:
                    got = in_child(args.run, variant, args.batch)
                    ms, seconds = got["ms"], got["seconds"]
                rows.append({"repeat": r, "variant": variant, "where": where, "ms": ms, "seconds": round(seconds, 2),
                             "load_1min": load, "cpus_busy_elsewhere": busy})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| protocol | time a cell | " + " | ".join(f"{k} ms (min-max)" for k in FILES) +
          " | largest spread | in process vs fresh (median) |\n|---|---:|" + "---:|" * len(FILES) + "---:|---:|")
    summary = {}
    for variant in VARIANTS:
        rs = [r for r in rows if r["variant"] == variant]
        spreads, cells = {}, []
        for k in FILES:
            v = [r["ms"][k] for r in rs]
            spreads[k] = max(v) / min(v)
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        inproc = statistics.median(r["ms"][k] for r in rs if r["where"] == "in process" for k in ("fp32",))
        fresh = statistics.median(r["ms"][k] for r in rs if r["where"] == "fresh process" for k in ("fp32",))
        seconds = statistics.median(r["seconds"] for r in rs)
        summary[variant] = {"spread": spreads, "seconds": seconds}
        print(f"| {variant} | {seconds:.1f} s | " + " | ".join(cells) +
              f" | {max(spreads.values()):.2f}x | fp32 {inproc:.2f} vs {fresh:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
