"""QAT int8 vs onnxruntime's own post-training static quantization of the same fp32 ONNX student.

onnxruntime's `quantize_static` (QDQ, per-channel int8 weights, uint8 activations, calibrated on 512 training
images) is what you would do without QAT. Same student, same validation set: accuracy, size, latency.

    compress run                                       # makes artifacts/default
    python benchmarks/bench_export.py artifacts/default

The export stage now writes its own post-training quantized file (export/model.ptq.onnx, calibrated on a seeded
random sample of export.ptq_calibration training images); when the run has one it is measured as a fourth row.
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compress.data.datasets import load_data  # noqa: E402
from compress.deploy.latency import latency_table  # noqa: E402
from compress.deploy.onnx_model import OnnxModel  # noqa: E402
from compress.run.config import load_config  # noqa: E402


class Calibration:
    """onnxruntime CalibrationDataReader over the first N training images (un-augmented, normalised)."""

    def __init__(self, dataset, count, input_name, batch=32):
        idx = list(range(min(count, len(dataset))))
        self.batches = [dataset.batch(idx[i:i + batch]).x.numpy() for i in range(0, len(idx), batch)]
        self.input_name, self.position = input_name, 0

    def get_next(self):
        if self.position >= len(self.batches):
            return None
        self.position += 1
        return {self.input_name: self.batches[self.position - 1]}

    def rewind(self):
        self.position = 0


def post_training_quantize(fp32_path, out_path, data, samples):
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = out_path + ".pre.onnx"
    quant_pre_process(fp32_path, prepared)
    reader = type("Reader", (Calibration, CalibrationDataReader), {})(data.train, samples, "input")
    quantize_static(prepared, out_path, reader, quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    os.unlink(prepared)


def accuracy(path, data):
    model = OnnxModel(path, require_metadata=False)
    correct = 0
    for start in range(0, len(data.val), 250):
        b = data.val.batch(range(start, min(start + 250, len(data.val))))
        correct += int((model(b.x.numpy()).argmax(1) == b.y.numpy()).sum())
    return 100.0 * correct / len(data.val)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", default="artifacts/default")
    parser.add_argument("--calibration-samples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = load_config(os.path.join(args.run_dir, "config.yaml"))
    data = load_data(cfg.data, cfg.seed)
    fp32 = os.path.join(args.run_dir, "export", "model.fp32.onnx")
    qat = os.path.join(args.run_dir, "export", "model.int8.onnx")
    stage_ptq = os.path.join(args.run_dir, "export", "model.ptq.onnx")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        ptq = os.path.join(tmp, "model.ptq.onnx")
        post_training_quantize(fp32, ptq, data, args.calibration_samples)
        files = [("fp32 ONNX", fp32), ("QAT int8 (compress)", qat),
                 (f"onnxruntime PTQ int8 ({args.calibration_samples} calibration images)", ptq)]
        if os.path.isfile(stage_ptq):
            files.append(("onnxruntime PTQ int8 (the export stage's model.ptq.onnx)", stage_ptq))
        for name, path in files:
            cells = latency_table(path, (1, 64), repeats=args.repeats, warmup=10)
            rows[name] = {"val_acc": accuracy(path, data), "bytes": os.path.getsize(path),
                          "latency_ms": {f"b{c['batch']}_t{c['threads']}": c["ms"] for c in cells}}
    cores = os.cpu_count()
    print(f"\n{len(data.val)} validation images; median onnxruntime latency, {args.repeats} runs\n")
    print(f"| model | val acc | size | b1, 1 thread | b64, 1 thread | b64, {cores} threads |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        lat = r["latency_ms"]
        print(f"| {name} | {r['val_acc']:.2f}% | {r['bytes'] / 1e3:.0f} KB | {lat['b1_t1']:.3f} ms | "
              f"{lat['b64_t1']:.2f} ms | {lat[f'b64_t{cores}']:.2f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    np.random.seed(0)
    main()
