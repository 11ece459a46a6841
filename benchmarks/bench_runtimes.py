"""int8 / fp32 latency of the same student in the runtimes users deploy to: onnxruntime (in this process) and
OpenVINO (in its own process, as compress always runs it), batch 1 and batch 64, all cores. The files are made
as the export stage makes them: the float model exported, and the int8 model from FX QAT preparation with every
layer int8 (calibrated on random images: latency does not depend on the values), converted and exported to
clean QDQ. fp32 and int8 are timed interleaved, in rounds, and the median over the rounds is reported.

    python benchmarks/bench_runtimes.py --rounds 5 --json benchmarks/results/runtimes.json
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

from compress.deploy.runtimes import RUNTIMES
from compress.deploy.timing import Protocol
from compress.models.registry import build_model
from compress.quant import fx
from compress.quant.onnx_export import export_onnx

MODELS = (("compact_cnn", 32), ("light_cnn", 32), ("mobilenet_v2", 64), ("resnet18", 64))


def make_files(name, size, folder):
    torch.manual_seed(0)
    model = build_model(name, (3, size, size), 10).eval()
    example = torch.randn(2, 3, size, size)
    paths = {"fp32": os.path.join(folder, f"{name}.fp32.onnx"), "int8": os.path.join(folder, f"{name}.int8.onnx")}
    export_onnx(model, example, paths["fp32"], 21, {})
    prepared = fx.prepare(build_model(name, (3, size, size), 10), example).eval()
    with torch.no_grad():
        for _ in range(4):
            prepared(torch.randn(32, 3, size, size))
    export_onnx(fx.convert(prepared), example, paths["int8"], 21, {})
    return paths


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    threads = os.cpu_count() or 1
    runtimes = [name for name, r in RUNTIMES.items() if r.available()]
    out = {"command": "python benchmarks/bench_runtimes.py " + " ".join(sys.argv[1:]), "threads": threads, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in MODELS:
            paths = make_files(name, size, tmp)
            for batch in (1, 64):
                x = np.random.default_rng(0).standard_normal((batch, 3, size, size), dtype=np.float32)
                for runtime in runtimes:  # the medians of every run, 0.25 s a file a round, as this table always had
                    cells = RUNTIMES[runtime].measure(paths, x, [batch], [threads],
                                                      Protocol(rounds=args.rounds, round_s=0.25, most=50, warmup=2))
                    row = {"model": name, "size": size, "batch": batch, "runtime": runtime,
                           "fp32_ms": cells["fp32"][0]["median_ms"], "int8_ms": cells["int8"][0]["median_ms"]}
                    row["int8_over_fp32"] = round(row["int8_ms"] / row["fp32_ms"], 3)
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
    print("\n| model | input | batch | " + " | ".join(f"{r}: fp32 ms, int8 ms, int8/fp32" for r in runtimes) + " |")
    print("|---|---:|---:|" + "---:|" * len(runtimes))
    for name, size in MODELS:
        for batch in (1, 64):
            cells = []
            for runtime in runtimes:
                r = next(x for x in out["rows"] if (x["model"], x["batch"], x["runtime"]) == (name, batch, runtime))
                cells.append(f"{r['fp32_ms']:.3f}, {r['int8_ms']:.3f}, **{r['int8_over_fp32']:.2f}**")
            print(f"| {name} | {size}x{size} | {batch} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
