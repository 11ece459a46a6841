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
    meta = {"model": model_name, "dataset": data.name, "class_names": list(data.class_names),
            "input_shape": list(data.input_shape), "channel_order": "gray" if data.input_shape[0] == 1 else "RGB",
            "pixel_scale": "1/255", "mean": list(data.mean), "std": list(data.std),
            "compress_version": __version__}
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
    report["int8"] = compare(int8_model, deploy.OnnxModel(paths["int8"]), loader)
    ops = deploy.optimized_op_types(paths["int8"])
    report["int8_kernels"] = {op: n for op, n in ops.items() if op in deploy.INT8_KERNELS}
    report["int8_optimized_ops"] = ops
    stop_if_asked("after checking parity")
    report["latency_ms"] = {k: deploy.latency_table(p, e.latency_batch_sizes, repeats=e.latency_repeats,
                                                    warmup=e.latency_warmup, stop=stop_if_asked)
                            for k, p in paths.items()}
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
    model = quant.rebuild_int8(build_model(model_name, data.input_shape, data.num_classes), tensors, example,
                               q["backend"], q["activation_range"], q["per_channel"], path)
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
def compare(torch_model, onnx_model, loader):
    """onnxruntime vs PyTorch on the validation set: max |logit difference|, top-1 agreement, accuracies."""
    torch_model.eval()
    diff, agree, torch_correct, onnx_correct, count = 0.0, 0, 0, 0, 0
    for x, y, _ in loader:
        expected = torch_model(x).numpy()
        got = onnx_model(x.numpy())
        diff = max(diff, float(np.abs(expected - got).max()))
        agree += int((expected.argmax(1) == got.argmax(1)).sum())
        torch_correct += int((expected.argmax(1) == y.numpy()).sum())
        onnx_correct += int((got.argmax(1) == y.numpy()).sum())
        count += len(y)
    return {"max_abs_diff": diff, "top1_agreement": agree / count, "torch_acc": 100.0 * torch_correct / count,
            "onnx_acc": 100.0 * onnx_correct / count, "samples": count}


def checks(report, e):
    fp32, int8 = report["fp32"], report["int8"]
    return {
        "fp32_parity": {"ok": (fp32["max_abs_diff"] <= e.fp32_max_abs_diff
                               and fp32["top1_agreement"] >= e.fp32_min_agreement),
                        "detail": f"max |diff| {fp32['max_abs_diff']:.2e} (limit {e.fp32_max_abs_diff:g}), top-1 "
                                  f"agreement {fp32['top1_agreement']:.4f} (min {e.fp32_min_agreement})"},
        "int8_parity": {"ok": int8["top1_agreement"] >= e.int8_min_agreement,
                        "detail": f"top-1 agreement with torch int8 {int8['top1_agreement']:.4f} "
                                  f"(min {e.int8_min_agreement}), max |diff| {int8['max_abs_diff']:.3f}"},
        "int8_kernels": {"ok": bool(report["int8_kernels"]),
                         "detail": "onnxruntime runs " + (", ".join(report["int8_kernels"]) or
                                                          "no int8 kernels after optimisation")},
    }


def summary_metrics(report):
    lat = {k: {f"b{r['batch']}_t{r['threads']}": r["ms"] for r in rows} for k, rows in report["latency_ms"].items()}
    return {"params": report["params"], "fp32_onnx_acc": report["fp32"]["onnx_acc"],
            "int8_onnx_acc": report["int8"]["onnx_acc"],
            "fp32_bytes": report["size_bytes"]["fp32"], "int8_bytes": report["size_bytes"]["int8"],
            "size_ratio": report["size_ratio_int8_fp32"], "fp32_max_abs_diff": report["fp32"]["max_abs_diff"],
            "fp32_top1_agreement": report["fp32"]["top1_agreement"],
            "int8_top1_agreement": report["int8"]["top1_agreement"], "latency_ms": lat}


def _summary(report):
    big = max(r["batch"] for r in report["latency_ms"]["fp32"])
    cores = max(r["threads"] for r in report["latency_ms"]["fp32"])
    f, q = (next(r["ms"] for r in report["latency_ms"][k] if r["batch"] == big and r["threads"] == cores)
            for k in ("fp32", "int8"))
    return (f"fp32 ONNX {report['fp32']['onnx_acc']:.2f}% {report['size_bytes']['fp32'] / 1e3:.0f} KB, "
            f"int8 ONNX {report['int8']['onnx_acc']:.2f}% {report['size_bytes']['int8'] / 1e3:.0f} KB, "
            f"batch {big}, {cores} threads: int8 {q:.2f} ms vs fp32 {f:.2f} ms ({f / q:.2f}x faster)")


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
