"""export: float and int8 ONNX files, checked by onnx, run by onnxruntime, compared with PyTorch on the
validation set, timed, and measured. Runs on rank 0 only; it needs no process group."""

import logging
import os
import tempfile

from compress import __version__
from compress.data.datasets import load_data
from compress.data.sampling import eval_loader
from compress.deploy.latency import latency_table, speedup_text
from compress.deploy.onnx_model import INT8_KERNELS, OnnxModel, optimized_op_types
from compress.errors import CompressError, StageFailed
from compress.fileio import atomic_write_json
from compress.models.registry import build_model, count_parameters
from compress.quant import fx
from compress.quant.onnx_export import export_onnx
from compress.quant.verify import checks, compare, output_step, speed_gate
from compress.run.config import quantized_model
from compress.run.contract import Input, StageResult
from compress.training import interrupt
from compress.training.checkpoint import load_weights, read_weights

log = logging.getLogger(__name__)

NAME = "export"
SUMMARY = "float + int8 ONNX, verified with onnxruntime (parity, accuracy, int8 kernels, size, latency)"
CONFIG_KEYS = ("seed", "data", "-data.unlabeled", "model", "qat.source", "export")
OUTPUTS = {"fp32": "export/model.fp32.onnx", "int8": "export/model.int8.onnx", "report": "export/export.json"}
PARTS = ()
RANK0_ONLY = True


def inputs(cfg):
    # the teacher is timed for the report's comparison row only: optional, and a broken file just drops the row
    teacher = [Input("teacher", "model", required=False)] if cfg.qat.source == "distill" else []
    return [Input(cfg.qat.source, "model"), Input("qat", "model"), *teacher]


def run(ctx):
    cfg, e = ctx.cfg, ctx.cfg.export
    data = load_data(cfg.data, cfg.seed)
    source = cfg.qat.source
    model_name = quantized_model(cfg.model, source)
    float_model, _ = ctx.load_model(source, model_name, data)
    int8_model, qconfig = _rebuild_int8(ctx, model_name, data)
    ctx.begin()

    example = data.val.batch([0, 1]).x
    meta = deployment_metadata(model_name, data)
    paths = {"fp32": ctx.run.path(OUTPUTS["fp32"]), "int8": ctx.run.path(OUTPUTS["int8"])}
    export_onnx(float_model, example, paths["fp32"], e.opset,
                {**meta, "precision": "fp32", "source_sha256": ctx.input_sha256(source, "model")})
    stop_if_asked("after writing model.fp32.onnx")
    export_onnx(int8_model, example, paths["int8"], e.opset,
                {**meta, "precision": "int8", "source_sha256": ctx.input_sha256("qat", "model"), "qconfig": qconfig})
    stop_if_asked("after writing model.int8.onnx")

    loader = eval_loader(data.val, cfg.train.eval_batch_size, 0, 1)
    report = {"opset": e.opset, "params": count_parameters(float_model),
              "files": {k: os.path.basename(p) for k, p in paths.items()},
              "size_bytes": {k: os.path.getsize(p) for k, p in paths.items()}}
    report["size_ratio_int8_fp32"] = round(report["size_bytes"]["int8"] / report["size_bytes"]["fp32"], 4)
    report["fp32"] = compare(float_model, OnnxModel(paths["fp32"]), loader)
    # Two int8 implementations round differently, and the differences add up through a deep network: a pick
    # within two steps of the int8 logits' resolution from torch's best is a tie, not a disagreement
    step = output_step(paths["int8"])
    report["int8"] = compare(int8_model, OnnxModel(paths["int8"]), loader, tie=None if step is None else 2 * step)
    ops = optimized_op_types(paths["int8"])
    report["int8_kernels"] = {op: n for op, n in ops.items() if op in INT8_KERNELS}
    report["int8_optimized_ops"] = ops
    stop_if_asked("after checking parity")
    report["latency_ms"] = {k: latency_table(p, e.latency_batch_sizes, repeats=e.latency_repeats,
                                             warmup=e.latency_warmup, stop=stop_if_asked)
                            for k, p in paths.items()}
    batch = max(e.latency_batch_sizes)
    report["speed"] = speed_gate(paths, data.val.batch([i % len(data.val) for i in range(batch)]).x, e,
                                 stop=stop_if_asked)
    report["float_layers"] = qconfig.get("float_layers", [])
    report["mixed_precision"] = _mixed_precision_figures(ctx)
    reference = _teacher_reference(ctx, data, example, e) if source == "distill" else None
    if reference:
        report["latency_ms"]["teacher"], report["size_bytes"]["teacher_onnx"] = reference
        report["teacher_file"] = ctx.state.sources["teacher:model"]
    report["checks"] = checks(report, e)
    atomic_write_json(ctx.run.path(OUTPUTS["report"]), report)
    failed = [name for name, c in report["checks"].items() if not c["ok"]]
    if failed:
        details = "; ".join(f"{n}: {report['checks'][n]['detail']}" for n in failed)
        raise StageFailed(f"export: {len(failed)} check(s) failed - {details}; files kept in "
                          f"{ctx.run.rel(ctx.stage_path())}/, figures in export.json")
    return StageResult(summary_metrics(report), list(OUTPUTS.values()), _summary(report))


def deployment_metadata(model_name, data):
    """Everything a deployment needs to turn an image file into the model's input and its output into a class,
    in order, without guessing (compress.imageio implements exactly this; so does the README's snippet)."""
    channels, height, width = data.input_shape
    color = "L" if channels == 1 else "RGB"
    conversion = "8-bit grayscale, L = 0.299 R + 0.587 G + 0.114 B" if channels == 1 else "8-bit RGB"
    rule = data.resize
    return {
        "model": model_name, "dataset": data.name, "class_names": list(data.class_names),
        "input_name": "input", "layout": "NCHW", "input_dtype": "float32", "input_shape": [channels, height, width],
        "color": color, "channel_order": "gray" if channels == 1 else "RGB",
        "resize": rule, "pixel_scale": "1/255", "mean": list(data.mean), "std": list(data.std),
        "preprocessing": [
            f"decode the image; convert to {color} ({conversion}; 16-bit or float images: scale to 0..1 first)",
            f"resize so the shorter side is {rule['shorter_side']} px (bilinear, antialiased, keep the aspect ratio)",
            f"centre-crop {height}x{width}",
            "uint8 0..255 -> float32, divide by 255",
            "subtract mean and divide by std, per channel",
            "HWC -> CHW, add the batch axis first (NCHW)"],
        "output": "logits: unnormalised class scores [batch, classes]; softmax gives probabilities; index i is "
                  "class_names[i]",
        "compress_version": __version__}


def _mixed_precision_figures(ctx):
    """The latency-aware float-layer choice QAT made (its measurements), for export.json and the report."""
    entry = ctx.run.stage_entry("qat") or {}
    return (entry.get("metrics") or {}).get("mixed_precision")


def stop_if_asked(where="while timing"):
    """A first Ctrl-C/SIGTERM during export stops it at the next file boundary (files are written atomically,
    so each is whole or absent); the stage is left interrupted and reruns in full next time."""
    interrupt.stop_if_asked(f"during export ({where})", what="finish the export")


def _rebuild_int8(ctx, model_name, data):
    path = ctx.input_path("qat", "model")
    tensors, meta = read_weights(path, expect_stage="qat", expect_model=model_name,
                                 expect_sha256=ctx.input_sha256("qat", "model"))
    q = meta["qconfig"]
    example = data.val.batch([0, 1]).x
    model = fx.rebuild_int8(build_model(model_name, data.input_shape, data.num_classes), tensors, example, q, path)
    return model, q


def _teacher_reference(ctx, data, example, e):
    """The teacher's onnxruntime latency and ONNX size, for comparison in the report (file not kept)."""
    path = ctx.input_path("teacher", "model")
    if path is None:
        return None
    model = build_model(ctx.cfg.model.teacher, data.input_shape, data.num_classes)
    try:
        load_weights(model, path, expect_stage="teacher", expect_model=ctx.cfg.model.teacher,
                     expect_sha256=ctx.input_sha256("teacher", "model"))
    except CompressError as error:  # only a comparison row in the report: say why it is missing, go on
        log.warning("export: no teacher row in the report (%s)", error)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "teacher.onnx")
        export_onnx(model, example, path, e.opset, {})
        rows = latency_table(path, e.latency_batch_sizes, repeats=min(e.latency_repeats, 10),
                                    warmup=min(e.latency_warmup, 2), stop=stop_if_asked)
        return rows, os.path.getsize(path)


def summary_metrics(report):
    lat = {k: {f"b{r['batch']}_t{r['threads']}": r["ms"] for r in rows} for k, rows in report["latency_ms"].items()}
    return {"params": report["params"], "fp32_onnx_acc": report["fp32"]["onnx_acc"],
            "int8_onnx_acc": report["int8"]["onnx_acc"],
            "fp32_bytes": report["size_bytes"]["fp32"], "int8_bytes": report["size_bytes"]["int8"],
            "size_ratio": report["size_ratio_int8_fp32"], "fp32_max_abs_diff": report["fp32"]["max_abs_diff"],
            "fp32_top1_agreement": report["fp32"]["top1_agreement"],
            "int8_top1_agreement": report["int8"]["top1_agreement"],
            "int8_top1_within_tie": report["int8"]["top1_within_tie"], "latency_ms": lat,
            "int8_speedup": report["speed"]["speedup"], "float_layers": report["float_layers"]}


def _summary(report):
    s = report["speed"]
    return (f"fp32 ONNX {report['fp32']['onnx_acc']:.2f}% {report['size_bytes']['fp32'] / 1e3:.0f} KB, "
            f"int8 ONNX {report['int8']['onnx_acc']:.2f}% {report['size_bytes']['int8'] / 1e3:.0f} KB, "
            f"batch {s['batch']}, {s['threads']} threads: int8 {s['int8_ms']:.2f} ms vs fp32 {s['fp32_ms']:.2f} ms "
            f"({speedup_text(s['speedup'])})")


def report_rows(entry, path):
    """The two ONNX rows, and the teacher's latency (measured here) for the teacher's row."""
    from compress.fileio import read_json

    export = read_json(path("report"), "export report")
    params = entry["metrics"].get("params")
    rows = []
    for kind in ("fp32", "int8"):
        b1, b64 = _latency_pair(export["latency_ms"][kind])
        rows.append({"id": f"{kind}_onnx", "artifact": f"{kind} ONNX (onnxruntime)", "file": OUTPUTS[kind],
                     "params": params, "size_bytes": export["size_bytes"][kind], "val_acc": export[kind]["onnx_acc"],
                     "latency_b1_ms": b1, "latency_b64_ms": b64})
    if "teacher" in export["latency_ms"]:
        b1, b64 = _latency_pair(export["latency_ms"]["teacher"])
        rows.append({"id": "teacher", "latency_b1_ms": b1, "latency_b64_ms": b64,
                     "measured_from": export["teacher_file"]})
    return rows


def _latency_pair(cells):
    """(batch-1, largest-batch) milliseconds on the most threads measured."""
    best = max(c["threads"] for c in cells)
    pick = {c["batch"]: c["ms"] for c in cells if c["threads"] == best}
    return pick.get(1), pick.get(max(pick))
