"""fp32 vs int8 ONNX of finished runs, side by side: size, latency (batch 1 and 64, 1 and 2 threads, measured
interleaved in rounds on the run's own validation images), accuracy, and which layers stayed float.

    python benchmarks/bench_int8.py artifacts/default artifacts/cifar10 ...

Each RUN_DIR must have completed the export stage. Accuracy and float layers come from its export.json and
qat metrics (the whole validation set); latencies are measured now. With --reference N, onnx's own reference
evaluator (a second, independent ONNX implementation) also runs both files on N validation images and the top-1
agreement with onnxruntime is reported.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compress.data.datasets import load_data  # noqa: E402
from compress.deploy.latency import compare_latency  # noqa: E402
from compress.deploy.onnx_model import OnnxModel  # noqa: E402
from compress.run.config import load_config  # noqa: E402


def measure(run, rounds, reference=0):
    export = json.load(open(os.path.join(run, "export", "export.json")))
    manifest = json.load(open(os.path.join(run, "manifest.json")))["stages"]
    cfg = load_config(os.path.join(run, "config.yaml"))
    data = load_data(cfg.data, cfg.seed)
    paths = {k: os.path.join(run, "export", f"model.{k}.onnx") for k in ("fp32", "int8")}
    row = {"run": os.path.basename(os.path.normpath(run)), "model": cfg.model.student,
           "input": "x".join(map(str, data.input_shape)),
           "fp32_bytes": export["size_bytes"]["fp32"], "int8_bytes": export["size_bytes"]["int8"],
           "fp32_acc": export["fp32"]["onnx_acc"], "int8_acc": export["int8"]["onnx_acc"],
           "float_layers": export.get("float_layers", []),
           "qat_float_acc": manifest["qat"]["metrics"]["float_acc"], "latency": {}}
    for batch in (1, 64):
        x = data.val.batch([i % len(data.val) for i in range(batch)]).x.numpy()
        for threads in (1, 2):
            models = {k: OnnxModel(p, threads=threads, require_metadata=False) for k, p in paths.items()}
            t = compare_latency(models, x, rounds=rounds)
            row["latency"][f"b{batch}_t{threads}"] = {k: round(v["min_ms"], 3) for k, v in t.items()}
    if reference:
        import onnx
        from onnx.reference import ReferenceEvaluator

        x = data.val.batch(range(min(reference, len(data.val)))).x.numpy()
        row["reference_agreement"] = {}
        for k, p in paths.items():
            ref = ReferenceEvaluator(onnx.load(p)).run(None, {"input": x})[0]
            ort = OnnxModel(p, require_metadata=False)(x)
            row["reference_agreement"][k] = {"images": len(x), "top1": float((ref.argmax(1) == ort.argmax(1)).mean())}
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reference", type=int, default=0, metavar="N",
                        help="also run both files in onnx's reference evaluator on N validation images")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [measure(run, args.rounds, args.reference) for run in args.runs]
    print("| student (run) | input | size fp32 -> int8 | b1 1t ms | b1 2t ms | b64 1t ms | b64 2t ms | "
          "accuracy fp32 -> int8 | float layers |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = []
        for key in ("b1_t1", "b1_t2", "b64_t1", "b64_t2"):
            f, q = r["latency"][key]["fp32"], r["latency"][key]["int8"]
            cells.append(f"{f:.3g} -> {q:.3g} ({q / f:.2f}x)")
        print(f"| {r['model']} ({r['run']}) | {r['input']} | {r['fp32_bytes'] / 1e3:.0f} KB -> "
              f"{r['int8_bytes'] / 1e3:.0f} KB ({r['int8_bytes'] / r['fp32_bytes']:.2f}x) | " + " | ".join(cells) +
              f" | {r['fp32_acc']:.2f}% -> {r['int8_acc']:.2f}% | {', '.join(r['float_layers']) or 'none'} |")
    for r in rows:
        if "reference_agreement" in r:
            print(f"{r['model']} ({r['run']}): onnx reference evaluator vs onnxruntime, top-1 agreement "
                  + ", ".join(f"{k} {v['top1']:.1%} of {v['images']}" for k, v in r["reference_agreement"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
