"""Do onnxruntime's spinning threads slow the next file a latency table times? A probe for BENCHMARKS.md.

One run's fp32, QAT int8 and PTQ int8 files (the two int8 graphs are op-for-op identical after onnxruntime's
fusions, so their figures should agree) are timed together by compress's protocol
(compress.deploy.timing.compare_latency: 5 rounds in turns, the median of each round's fastest call), batch 1
and 64 on 2 threads, with sessions opened in each --modes, the modes taking turns over --repeats:
  default  onnxruntime's defaults (threads spin between calls);
  stop     session.force_spinning_stop=1 (threads spin during a call, sleep when it returns: compress's sessions);
  nospin   session.intra_op.allow_spinning=0 (threads never spin);
  alone    default sessions, each file timed on its own, one after the other.

    python benchmarks/probe_spinning.py --export /tmp/photos_r10_hinton/seed0/export --modes default,stop \\
        --repeats 10 --json benchmarks/results/spinning.json
"""

import argparse
import json
import statistics
import sys
import time

from compress.deploy.latency import timing_input
from compress.deploy.timing import compare_latency

FILES = {"fp32": "model.fp32.onnx", "int8": "model.int8.onnx", "ptq": "model.ptq.onnx"}


def session(path, threads, mode):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if mode == "stop":
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if mode == "nospin":
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    return lambda batch: s.run(None, {name: batch})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="a finished run's export/ folder")
    p.add_argument("--modes", default="default,stop")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    paths = {k: f"{args.export}/{f}" for k, f in FILES.items()}
    x = timing_input(paths["fp32"], 64)
    modes, rows = args.modes.split(","), []
    for rep in range(args.repeats):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            for b in (1, 64):
                if mode == "alone":
                    got = {}
                    for name, path in paths.items():
                        got.update(compare_latency({name: session(path, args.threads, "default")}, x[:b], rounds=5,
                                                   budget_s=0.05, warmup=5, most=30))
                        time.sleep(0.5)
                else:
                    models = {name: session(path, args.threads, mode) for name, path in paths.items()}
                    got = compare_latency(models, x[:b], rounds=5, budget_s=0.05, warmup=5, most=30)
                    del models
                rows.append({"rep": rep, "mode": mode, "b": b, **{n: round(v["ms"], 3) for n, v in got.items()}})
                print(json.dumps(rows[-1]), flush=True)
                time.sleep(0.5)
    print("\n| sessions | batch | fp32 ms | QAT int8 ms | PTQ int8 ms | QAT / PTQ int8 (range) "
          "| fp32 / QAT int8 (range) |"
          "\n|---|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        for b in (1, 64):
            r = [row for row in rows if row["mode"] == mode and row["b"] == b]
            same = [row["int8"] / row["ptq"] for row in r]
            gain = [row["fp32"] / row["int8"] for row in r]
            med = {k: statistics.median(row[k] for row in r) for k in FILES}
            print(f"| {mode} | {b} | {med['fp32']:.3f} | {med['int8']:.3f} | {med['ptq']:.3f} | "
                  f"{statistics.median(same):.2f} ({min(same):.2f}-{max(same):.2f}) | "
                  f"{statistics.median(gain):.2f} ({min(gain):.2f}-{max(gain):.2f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/probe_spinning.py " + " ".join(sys.argv[1:]), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
