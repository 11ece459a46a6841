"""export: float and int8 ONNX files, checked by onnx, run by onnxruntime, compared with PyTorch on the
validation set, timed, and measured. Runs on rank 0 only; it needs no process group."""

import logging
import os
import tempfile

import numpy as np
import torch

from compress import __version__, deploy, interrupt, quant
from compress.checkpoint import load_weights, read_weights
from compress.context import Input, StageResult
from compress.data import eval_loader, load_data
from compress.errors import CompressError, Interrupted, StageFailed
from compress.fileio import atomic_write_json
from compress.models import build_model, count_parameters
from compress.to_onnx import export_onnx

log = logging.getLogger(__name__)

NAME = "export"
SUMMARY = "float + int8 ONNX, verified with onnxruntime (parity, accuracy, int8 kernels, size, latency)"
CONFIG_KEYS = ("seed", "data", "model", "qat.source", "export")
OUTPUTS = {"fp32": "export/model.fp32.onnx", "int8": "export/model.int8.onnx", "report": "export/export.json"}
RANK0_ONLY = True


def inputs(cfg):
    # the teacher is timed for the report's comparison row only: optional, and a broken file just drops the row
    teacher = [Input("teacher", "model", required=False)] if cfg.qat.source == "distill" else []
    return [Input(cfg.qat.source, "model"), Input("qat", "model"), *teacher]


def run(ctx):
    cfg, e = ctx.cfg, ctx.cfg.export
    data = load_data(cfg.data, cfg.seed)
    source = cfg.qat.source
    model_name = cfg.model.student if source == "distill" else cfg.model.teacher
    float_model, _ = ctx.load_model((source, "model"), model_name, data)
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
    report["fp32"] = compare(float_model, deploy.OnnxModel(paths["fp32"]), loader)
    # Two int8 implementations round differently, and the differences add up through a deep network: a pick
    # within two steps of the int8 logits' resolution from torch's best is a tie, not a disagreement
    step = output_step(paths["int8"])
    report["int8"] = compare(int8_model, deploy.OnnxModel(paths["int8"]), loader,
                             tie=None if step is None else 2 * step)
    ops = deploy.optimized_op_types(paths["int8"])
    report["int8_kernels"] = {op: n for op, n in ops.items() if op in deploy.INT8_KERNELS}
    report["int8_optimized_ops"] = ops
    stop_if_asked("after checking parity")
    report["latency_ms"] = {k: deploy.latency_table(p, e.latency_batch_sizes, repeats=e.latency_repeats,
                                                    warmup=e.latency_warmup, stop=stop_if_asked)
                            for k, p in paths.items()}
    report["speed"] = speed_gate(paths, data, e)
    report["float_layers"] = qconfig.get("float_layers", [])
    report["mixed_precision"] = _mixed_precision_figures(ctx)
    reference = _teacher_reference(ctx, data, example, e) if source == "distill" else None
    if reference:
        report["latency_ms"]["teacher"], report["size_bytes"]["teacher_onnx"] = reference
        report["teacher_file"] = ctx.sources[("teacher", "model")]
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


def speed_gate(paths, data, e):
    """int8 vs fp32 at the largest latency batch on all cores, on real validation images, interleaved in
    rounds; the ratio of the two minima (the estimate least disturbed by other processes). A ratio below
    export.min_int8_speedup is measured once more, longer, before it can fail the stage."""
    batch, threads = max(e.latency_batch_sizes), os.cpu_count() or 1
    idx = [i % len(data.val) for i in range(batch)]
    x = data.val.batch(idx).x.numpy()
    models = {k: deploy.OnnxModel(p, threads=threads, require_metadata=False) for k, p in paths.items()}
    attempts = []
    for rounds in (5, 11):
        times = deploy.compare_latency(models, x, rounds=rounds, stop=stop_if_asked)
        attempts.append({"rounds": rounds, "fp32_ms": round(times["fp32"]["min_ms"], 4),
                         "int8_ms": round(times["int8"]["min_ms"], 4),
                         "fp32_median_ms": round(times["fp32"]["median_ms"], 4),
                         "int8_median_ms": round(times["int8"]["median_ms"], 4)})
        if attempts[-1]["fp32_ms"] / attempts[-1]["int8_ms"] >= e.min_int8_speedup:
            break
    best = max(attempts, key=lambda a: a["fp32_ms"] / a["int8_ms"])
    speedup = best["fp32_ms"] / best["int8_ms"]
    return {"batch": batch, "threads": threads, "speedup": round(speedup, 4), "min_speedup": e.min_int8_speedup,
            "fp32_ms": best["fp32_ms"], "int8_ms": best["int8_ms"], "attempts": attempts}


def _mixed_precision_figures(ctx):
    """The latency-aware float-layer choice QAT made (its measurements), for export.json and the report."""
    entry = ctx.run.stage_entry("qat") or {}
    return (entry.get("metrics") or {}).get("mixed_precision")


def stop_if_asked(where="while timing"):
    """A first Ctrl-C/SIGTERM during export stops it at the next file boundary (files are written atomically,
    so each is whole or absent); the stage is left interrupted and reruns in full next time."""
    if interrupt.local_request():
        raise Interrupted(f"interrupted during export ({where}); rerun the same command to finish the export")


def _rebuild_int8(ctx, model_name, data):
    path = ctx.input_path("qat", "model")
    tensors, meta = read_weights(path, expect_stage="qat", expect_model=model_name,
                                 expect_sha256=ctx.input_sha256("qat", "model"))
    q = meta["qconfig"]
    example = data.val.batch([0, 1]).x
    model = quant.rebuild_int8(build_model(model_name, data.input_shape, data.num_classes), tensors, example, q, path)
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
        rows = deploy.latency_table(path, e.latency_batch_sizes, repeats=min(e.latency_repeats, 10),
                                    warmup=min(e.latency_warmup, 2), stop=stop_if_asked)
        return rows, os.path.getsize(path)


@torch.no_grad()
def compare(torch_model, onnx_model, loader, tie=0.0):
    """onnxruntime vs PyTorch on the validation set: max |logit difference|, top-1 agreement, accuracies.
    `top1_within_tie` also counts an image as agreeing when onnxruntime's pick scores within `tie` of the best
    class in PyTorch's own logits: a near-tie that a rounding difference may break either way. tie=None: two
    steps of 8-bit resolution over the logits' range (what an int8 output would have, for logits left float)."""
    torch_model.eval()
    expected, got, labels = [], [], []
    for x, y, *_ in loader:
        expected.append(torch_model(x).numpy())
        got.append(onnx_model(x.numpy()))
        labels.append(y.numpy())
    expected, got, labels = np.concatenate(expected), np.concatenate(got), np.concatenate(labels)
    if tie is None:
        tie = 2 * float(expected.max() - expected.min()) / 255
    picked = got.argmax(1)
    within = expected[np.arange(len(picked)), picked] >= expected.max(1) - tie
    return {"max_abs_diff": float(np.abs(expected - got).max()),
            "top1_agreement": float((expected.argmax(1) == picked).mean()), "top1_within_tie": float(within.mean()),
            "tie": tie, "torch_acc": 100.0 * float((expected.argmax(1) == labels).mean()),
            "onnx_acc": 100.0 * float((picked == labels).mean()), "samples": len(labels)}


def output_step(path):
    """The quantization step of an int8 model's logits (the scale of the DequantizeLinear that produces the
    graph output), or None when the logits come out of a layer kept in float."""
    from onnx import numpy_helper

    graph = deploy.read_onnx(path).graph
    consts = {t.name: t for t in graph.initializer}
    producer = next((n for n in graph.node if graph.output[0].name in n.output), None)
    if producer is None or producer.op_type != "DequantizeLinear" or producer.input[1] not in consts:
        return None
    scale = numpy_helper.to_array(consts[producer.input[1]])
    return float(scale) if scale.size == 1 else None


def checks(report, e):
    fp32, int8 = report["fp32"], report["int8"]
    return {
        "fp32_parity": {"ok": (fp32["max_abs_diff"] <= e.fp32_max_abs_diff
                               and fp32["top1_agreement"] >= e.fp32_min_agreement),
                        "detail": f"max |diff| {fp32['max_abs_diff']:.2e} (limit {e.fp32_max_abs_diff:g}), top-1 "
                                  f"agreement {fp32['top1_agreement']:.4f} (min {e.fp32_min_agreement})"},
        "int8_parity": {"ok": int8["top1_within_tie"] >= e.int8_min_agreement,
                        "detail": f"top-1 agreement with torch int8 {int8['top1_within_tie']:.4f} counting picks "
                                  f"within {int8['tie']:.3g} (2 steps of 8-bit logits) of torch's best as ties, exact "
                                  f"{int8['top1_agreement']:.4f} (min {e.int8_min_agreement}), "
                                  f"max |diff| {int8['max_abs_diff']:.3f}"},
        "int8_kernels": {"ok": bool(report["int8_kernels"]),
                         "detail": "onnxruntime runs " + (", ".join(report["int8_kernels"]) or
                                                          "no int8 kernels after optimisation")},
        "int8_speed": _speed_check(report["speed"], e),
    }


def _speed_check(speed, e):
    ratio = speed["speedup"]
    detail = (f"int8 {speed['int8_ms']:.2f} ms vs fp32 {speed['fp32_ms']:.2f} ms at batch {speed['batch']}, "
              f"{speed['threads']} threads: {deploy.speedup_text(ratio)} (needed {e.min_int8_speedup:g}x)")
    if ratio < e.min_int8_speedup:
        detail += ("; keep more layers in float (qat.float_layers), choose a student with more channels per layer, "
                   "or accept it with export.min_int8_speedup=0")
    return {"ok": ratio >= e.min_int8_speedup, "detail": detail}


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
            f"({deploy.speedup_text(s['speedup'])})")


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
