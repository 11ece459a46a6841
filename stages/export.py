"""export: float and int8 ONNX files, checked by onnx, run by onnxruntime, compared with PyTorch on the
validation set, timed in every runtime asked for, and measured beside onnxruntime's post-training quantization
of the same float model; it ends with a verdict - which file to deploy and why. Runs on rank 0 only; it needs
no process group."""

import logging
import os
import tempfile

import torch

from compress import __version__
from compress.cpus import busy_elsewhere, usable_cpus
from compress.data.sampling import eval_loader
from compress.deploy.latency import latency_table, latency_tables, speedup_text
from compress.deploy.onnx_model import INT8_KERNELS, OnnxModel, optimized_op_types
from compress.deploy.runtimes import default_runtimes
from compress.errors import CompressError, StageFailed
from compress.fileio import atomic_write_json, read_json
from compress.models.registry import build_model, count_parameters
from compress.quant import fx, verify
from compress.quant.onnx_export import export_onnx
from compress.quant.ptq import quantize_ptq
from compress.quant.verify import checks, compare, onnx_correct, output_step, speed_gate
from compress.run.config import quantized_model
from compress.run.contract import Code, Images, Input, StageResult
from compress.training import interrupt
from compress.training.checkpoint import load_weights, read_weights
from compress.training.paired import p_text, paired

log = logging.getLogger(__name__)

NAME = "export"
SUMMARY = "float + int8 ONNX, verified with onnxruntime (parity, accuracy, int8 kernels, size, latency)"
CONFIG_KEYS = ("seed", "data", "-data.unlabeled", "model", "qat.source", "export")
OUTPUTS = {"fp32": "export/model.fp32.onnx", "int8": "export/model.int8.onnx", "ptq": "export/model.ptq.onnx",
           "report": "export/export.json"}
PARTS = ()
RANK0_ONLY = True


def inputs(cfg):
    # the teacher is timed for the report's comparison row only: optional, and a broken file just drops the row
    teacher = [Input("teacher", "model", required=False)] if cfg.qat.source == "distill" else []
    return [Input(cfg.qat.source, "model"), Input("qat", "model"), *teacher, Images("root"),
            Code("model.student" if cfg.qat.source == "distill" else "model.teacher")]


def run(ctx):
    cfg, e = ctx.cfg, ctx.cfg.export
    data = ctx.load_data()
    model_name = quantized_model(cfg.model, cfg.qat.source)
    float_model, _ = ctx.load_model(cfg.qat.source, model_name, data)
    int8_model, qconfig = _rebuild_int8(ctx, model_name, data)
    runtimes = list(e.runtimes or default_runtimes())  # checked installed before anything was written
    ctx.begin()
    paths = _write_files(ctx, float_model, int8_model, qconfig, model_name, data)
    loader = eval_loader(data.val, cfg.train.eval_batch_size, 0, 1)
    report = {"opset": e.opset, "params": count_parameters(float_model),
              "files": {k: os.path.basename(p) for k, p in paths.items()},
              "size_bytes": {k: os.path.getsize(p) for k, p in paths.items()}}
    report["size_ratio_int8_fp32"] = round(report["size_bytes"]["int8"] / report["size_bytes"]["fp32"], 4)
    report.update(_parity(float_model, int8_model, paths, loader))
    stop_if_asked("after checking parity")
    # timings beside a busy neighbour are noisy (the fresh-user pass: 1.08x vs 2.07x); not asked with several
    # processes, whose other ranks wait for this one (NCCL's wait spins a core) and would be counted
    busy = busy_elsewhere() if ctx.env.world == 1 else None
    if busy is not None:
        report["cpus_busy_while_timing"] = round(busy, 1)
        if busy >= BUSY:
            log.warning("export: %s", _busy_note(busy, ctx.stage_path()))
    report["runtimes"] = {rt: latency_tables(paths, e.latency_batch_sizes, repeats=e.latency_repeats,
                                             warmup=e.latency_warmup, stop=stop_if_asked, runtime=rt)
                          for rt in runtimes}
    report["latency_ms"] = dict(report["runtimes"][runtimes[0]])  # the deciding runtime's: the report's columns
    batch = max(e.latency_batch_sizes)
    # the int8 file the verdict weighs: QAT's, or PTQ's when that is more accurate beyond noise
    kind = verify.int8_choice(report)
    report["speed"] = speed_gate({"fp32": paths["fp32"], "int8": paths[kind]},
                                 data.val.batch([i % len(data.val) for i in range(batch)]).x, e,
                                 stop=stop_if_asked, runtime=runtimes[0])
    report["speed"]["int8_file"] = report["files"][kind]
    report["float_layers"] = qconfig.get("float_layers", [])
    report["mixed_precision"] = _mixed_precision_figures(ctx)
    reference = _teacher_reference(ctx, data, e, runtimes[0]) if cfg.qat.source == "distill" else None
    if reference:
        report["latency_ms"]["teacher"], report["size_bytes"]["teacher_onnx"] = reference
        report["teacher_file"] = ctx.state.sources["teacher:model"]
    report["checks"] = checks(report, e)
    sizes = {"fp32": report["size_bytes"]["fp32"], "int8": report["size_bytes"][kind]}
    accuracy = {"fp32": report["fp32"]["onnx_acc"], "int8": report[kind]["onnx_acc"]}
    report["verdict"] = verify.verdict(report["speed"], sizes, accuracy, report["float_layers"], e,
                                       int8_file=report["files"][kind],
                                       ptq=report["ptq"]["vs_qat"] if kind == "ptq" else None)
    atomic_write_json(ctx.run.path(OUTPUTS["report"]), report)
    kept = f"files kept in {ctx.run.rel(ctx.stage_path())}/, figures in export.json"
    failed = [name for name, c in report["checks"].items() if not c["ok"]]
    if failed:
        details = "; ".join(f"{n}: {report['checks'][n]['detail']}" for n in failed)
        raise StageFailed(f"export: {len(failed)} check(s) failed - {details}; {kept}")
    if e.require_faster_int8 and not report["verdict"]["int8_faster"]:
        raise StageFailed(f"export: {report['verdict']['why']}; {kept} (export.require_faster_int8 is true: set it "
                          "to false to finish with the fp32 file as the one to deploy)")
    return StageResult(summary_metrics(report), [OUTPUTS[k] for k in (*paths, "report")], _summary(report))


def _write_files(ctx, float_model, int8_model, qconfig, model_name, data):
    """The fp32, QAT int8 and (export.ptq) post-training int8 ONNX files, each with the deployment metadata;
    a Ctrl-C between files leaves whole files only."""
    e = ctx.cfg.export
    example = data.example()
    meta = deployment_metadata(model_name, data)
    paths = {"fp32": ctx.run.path(OUTPUTS["fp32"]), "int8": ctx.run.path(OUTPUTS["int8"])}
    source_sha = ctx.input_sha256(ctx.cfg.qat.source, "model")
    export_onnx(float_model, example, paths["fp32"], e.opset,
                {**meta, "precision": "fp32", "source_sha256": source_sha})
    stop_if_asked("after writing model.fp32.onnx")
    export_onnx(int8_model, example, paths["int8"], e.opset,
                {**meta, "precision": "int8", "source_sha256": ctx.input_sha256("qat", "model"), "qconfig": qconfig,
                 "quantization": "quantization-aware training (FX), converted to QDQ"})
    stop_if_asked("after writing model.int8.onnx")
    if e.ptq:
        paths["ptq"] = ctx.run.path(OUTPUTS["ptq"])
        order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(ctx.cfg.seed)).tolist()
        calibration = data.train.batch(order[:e.ptq_calibration]).x.numpy()  # un-augmented training images
        how = (f"onnxruntime static post-training quantization (QDQ, MinMax over {len(calibration)} training images, "
               f"{'per-channel' if qconfig['per_channel'] else 'per-tensor'} int8 weights, uint8 activations)")
        quantize_ptq(float_model, example, calibration, paths["ptq"], e.opset, qconfig["per_channel"],
                     qconfig.get("float_layers", []), {**meta, "precision": "int8", "source_sha256": source_sha,
                                                       "quantization": how})
        stop_if_asked("after writing model.ptq.onnx")
    return paths


def _parity(float_model, int8_model, paths, loader):
    """fp32 and QAT int8 files against their PyTorch models on the validation set, the int8 kernels onnxruntime
    runs, and the PTQ file's accuracy (it has no PyTorch counterpart)."""
    out = {"fp32": compare(float_model, OnnxModel(paths["fp32"]), loader)}
    out["fp32"].pop("correct")
    # Two int8 implementations round differently, and the differences add up through a deep network: a pick
    # within two steps of the int8 logits' resolution from torch's best is a tie, not a disagreement
    step = output_step(paths["int8"])
    out["int8"] = compare(int8_model, OnnxModel(paths["int8"]), loader, tie=None if step is None else 2 * step)
    qat_correct = out["int8"].pop("correct")
    ops = optimized_op_types(paths["int8"])
    out["int8_kernels"] = {op: n for op, n in ops.items() if op in INT8_KERNELS}
    out["int8_optimized_ops"] = ops
    if "ptq" in paths:
        ptq_correct = onnx_correct(OnnxModel(paths["ptq"]), loader)
        out["ptq"] = {"onnx_acc": 100.0 * float(ptq_correct.mean()) if len(ptq_correct) else 0.0,
                      "vs_qat": paired(qat_correct, ptq_correct),  # only_first: QAT alone right; only_second: PTQ
                      "int8_kernels": {op: n for op, n in optimized_op_types(paths["ptq"]).items()
                                       if op in INT8_KERNELS}}
    return out


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


RUNTIME_NAMES = {"openvino": "OpenVINO"}
BUSY = 0.5  # cores other processes kept busy, from which the timings are called noisy


def _busy_note(busy, folder):
    return (f"other processes kept {busy:.1f} of this machine's {usable_cpus()} usable CPUs busy as the timing began, "
            f"so the latency figures (the table and the int8-vs-fp32 verdict) are noisy; time the files again on a "
            f"quiet machine: compress bench {folder}/model.fp32.onnx {folder}/model.int8.onnx")


def stop_if_asked(where="while timing"):
    """A first Ctrl-C/SIGTERM during export stops it at the next file boundary (files are written atomically,
    so each is whole or absent); the stage is left interrupted and reruns in full next time."""
    interrupt.stop_if_asked(f"during export ({where})", what="finish the export")


def _rebuild_int8(ctx, model_name, data):
    path = ctx.input_path("qat", "model")
    tensors, meta = read_weights(path, expect_stage="qat", expect_model=model_name,
                                 expect_sha256=ctx.input_sha256("qat", "model"))
    q = meta["qconfig"]
    example = data.example()
    model = fx.rebuild_int8(build_model(model_name, data.input_shape, data.num_classes), tensors, example, q, path)
    return model, q


def _teacher_reference(ctx, data, e, runtime):
    """The teacher's latency (in the deciding runtime) and ONNX size, for comparison in the report (the file
    is not kept)."""
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
        export_onnx(model, data.example(), path, e.opset, {})
        rows = latency_table(path, e.latency_batch_sizes, repeats=min(e.latency_repeats, 10),
                             warmup=min(e.latency_warmup, 2), stop=stop_if_asked, runtime=runtime)
        return rows, os.path.getsize(path)


def summary_metrics(report):
    lat = {k: {f"b{r['batch']}_t{r['threads']}": r["ms"] for r in rows} for k, rows in report["latency_ms"].items()}
    v = report["verdict"]
    out = {"params": report["params"], "fp32_onnx_acc": report["fp32"]["onnx_acc"],
           "int8_onnx_acc": report["int8"]["onnx_acc"],
           "fp32_bytes": report["size_bytes"]["fp32"], "int8_bytes": report["size_bytes"]["int8"],
           "size_ratio": report["size_ratio_int8_fp32"], "fp32_max_abs_diff": report["fp32"]["max_abs_diff"],
           "fp32_max_scaled_diff": report["fp32"]["max_scaled_diff"],
           "fp32_top1_agreement": report["fp32"]["top1_agreement"],
           "int8_top1_agreement": report["int8"]["top1_agreement"],
           "int8_top1_within_tie": report["int8"]["top1_within_tie"], "latency_ms": lat,
           "int8_speedup": report["speed"]["speedup"], "speed_runtime": report["speed"]["runtime"],
           "int8_weighed": report["speed"].get("int8_file", "model.int8.onnx"),
           "runtimes": list(report["runtimes"]), "float_layers": report["float_layers"], "deploy": v["file"],
           "deploy_why": v["why"]}
    if "cpus_busy_while_timing" in report:
        out["cpus_busy_while_timing"] = report["cpus_busy_while_timing"]
    batch = max(c["batch"] for c in report["latency_ms"]["fp32"])
    for runtime, tables in list(report["runtimes"].items())[1:]:  # the deciding runtime's figures are the table's
        threads = max(c["threads"] for c in tables["fp32"])
        ms = {kind: next((c["ms"] for c in tables.get(kind, []) if (c["batch"], c["threads"]) == (batch, threads)),
                         None) for kind in ("fp32", "int8")}
        if None not in ms.values():
            out.setdefault("other_runtimes", {})[runtime] = {"batch": batch, "threads": threads, **ms}
    if "ptq" in report:
        pair = report["ptq"]["vs_qat"]
        out.update(ptq_onnx_acc=report["ptq"]["onnx_acc"], ptq_bytes=report["size_bytes"]["ptq"],
                   qat_minus_ptq_points=round(report["int8"]["onnx_acc"] - report["ptq"]["onnx_acc"], 4),
                   qat_only_right=pair["only_first"], ptq_only_right=pair["only_second"], qat_vs_ptq_p=pair["p"],
                   val_images=report["int8"]["samples"])
    return out


def _summary(report):
    s, v = report["speed"], report["verdict"]
    return (f"fp32 ONNX {report['fp32']['onnx_acc']:.2f}% {report['size_bytes']['fp32'] / 1e3:.0f} KB, "
            f"int8 ONNX {report['int8']['onnx_acc']:.2f}% {report['size_bytes']['int8'] / 1e3:.0f} KB"
            + (f", PTQ int8 {report['ptq']['onnx_acc']:.2f}%" if "ptq" in report else "")
            + f"; {s['runtime']}, batch {s['batch']}, {s['threads']} threads: int8"
            + (f" ({s['int8_file']})" if s.get("int8_file", "model.int8.onnx") != "model.int8.onnx" else "")
            + f" {s['int8_ms']:.2f} ms vs fp32 "
            f"{s['fp32_ms']:.2f} ms ({speedup_text(s['speedup'])}) - deploy {v['file']}")


ROW_NAMES = {"fp32": "fp32 ONNX", "int8": "int8 ONNX", "ptq": "int8 ONNX, post-training quantized, no QAT"}


def report_rows(entry, path):
    """The ONNX rows (fp32, QAT int8, PTQ int8), and the teacher's latency (measured here) for its row."""
    export = read_json(path("report"), "export report")
    params, runtime = entry["metrics"].get("params"), export["speed"]["runtime"]
    rows = []
    for kind in ("fp32", "int8", "ptq"):
        if kind not in export["latency_ms"]:
            continue
        b1, b64 = _latency_pair(export["latency_ms"][kind])
        rows.append({"id": f"{kind}_onnx", "artifact": f"{ROW_NAMES[kind]} ({runtime})",
                     "file": OUTPUTS[kind], "params": params, "size_bytes": export["size_bytes"][kind],
                     "val_acc": export[kind]["onnx_acc"], "latency_b1_ms": b1, "latency_b64_ms": b64})
    if "teacher" in export["latency_ms"]:
        b1, b64 = _latency_pair(export["latency_ms"]["teacher"])
        rows.append({"id": "teacher", "latency_b1_ms": b1, "latency_b64_ms": b64,
                     "measured_from": export["teacher_file"]})
    return rows


def report_notes(entry):
    """The verdict, what QAT bought over post-training quantization, and int8 vs fp32 in every runtime."""
    m = entry["metrics"]
    notes = [f"Deploy export/{m['deploy']}: {m['deploy_why']}.",
             "The fp32 ONNX file is the float student as the qat stage received it (before QAT); the int8 files are "
             "made from it - by QAT, and for comparison by post-training quantization."]
    for runtime, t in m.get("other_runtimes", {}).items():
        name = RUNTIME_NAMES.get(runtime, runtime)
        notes.append(f"In {name} (batch {t['batch']}, {t['threads']} threads): int8 {t['int8']:.3f} ms against fp32 "
                     f"{t['fp32']:.3f} ms ({speedup_text(t['fp32'] / t['int8'])}); the verdict weighs "
                     f"{m['speed_runtime']}'s timings.")
    if m.get("cpus_busy_while_timing", 0) >= BUSY:
        note = _busy_note(m["cpus_busy_while_timing"], "<run directory>/export")
        notes.append(note[0].upper() + note[1:] + ".")
    if "ptq_onnx_acc" in m:
        notes.append(f"QAT against post-training quantization of the same float student (onnxruntime static PTQ, "
                     f"model.ptq.onnx): {m['int8_onnx_acc']:.2f}% vs {m['ptq_onnx_acc']:.2f}% "
                     f"({m['qat_minus_ptq_points']:+.2f} points from the qat stage){_beyond_noise(m)}.")
    return notes


def _beyond_noise(m):
    """Whether QAT and PTQ differ by more than chance, from the images only one of them gets right."""
    if "qat_vs_ptq_p" not in m:  # an export from before this was measured
        return ""
    qat, ptq, p = m["qat_only_right"], m["ptq_only_right"], m["qat_vs_ptq_p"]
    told = (f"; of {m['val_images']:,} validation images, {qat} are right only with QAT and {ptq} only with PTQ "
            f"(McNemar p {p_text(p)})")
    if p >= 0.05:
        return told + ": within noise, so the two int8 files are equally accurate on this evidence"
    if qat > ptq:
        return told + ": QAT is more accurate beyond noise"
    if m.get("int8_weighed") == OUTPUTS["ptq"].split("/")[-1]:
        return (told + ": post-training quantization is more accurate beyond noise here, so model.ptq.onnx is the "
                "int8 file the verdict weighed against fp32, not the QAT file (a lower qat.lr may let QAT keep its "
                "accuracy)")
    if "int8_weighed" not in m:  # an export from before the verdict could weigh the PTQ file
        return (told + ": post-training quantization is more accurate beyond noise here; model.ptq.onnx is the "
                "int8 file to try first (its latency is in the table), or lower qat.lr")
    return (told + ": post-training quantization is more accurate beyond noise here, but onnxruntime runs no int8 "
            "kernel in model.ptq.onnx, so the verdict kept the QAT file; a lower qat.lr may let QAT keep its accuracy")


def _latency_pair(cells):
    """(batch-1, largest-batch) milliseconds on the most threads measured."""
    best = max(c["threads"] for c in cells)
    pick = {c["batch"]: c["ms"] for c in cells if c["threads"] == best}
    return pick.get(1), pick.get(max(pick))
