"""export: float and int8 ONNX files, checked by onnx, run by onnxruntime, compared with PyTorch on the
validation set, timed in every runtime asked for, and measured beside onnxruntime's post-training quantization
of the same float model; it ends with a verdict - which file to deploy and why. Runs on rank 0 only; it needs
no process group. What it measures is an ExportReport (compress.deploy.export_report), written as export.json."""

import dataclasses
import logging
import os
import tempfile

import torch

from compress.cpus import BusyMeter
from compress.data.sampling import eval_loader
from compress.deploy import export_report
from compress.deploy.export_report import ExportReport
from compress.deploy.latency import latency_table, latency_tables, protocol
from compress.deploy.onnx_model import deployment_metadata
from compress.deploy.runtimes import default_runtimes, label
from compress.errors import CompressError, StageFailed
from compress.fileio import atomic_write_json
from compress.models.registry import build_model, count_parameters
from compress.quant import fx, verdict
from compress.quant.onnx_export import export_onnx
from compress.quant.ptq import quantize_ptq
from compress.quant.verify import checks, measure_accuracy
from compress.run.config import QAT_SOURCES, quantized_model
from compress.run.contract import Code, Images, Input, StageResult
from compress.training import interrupt
from compress.training.checkpoint import load_weights, read_weights

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
    source = QAT_SOURCES[cfg.qat.source]
    teacher = [Input("teacher", "model", required=False)] if source.stage != "teacher" else []
    return [Input(source.stage, source.output), Input("qat", "model"), *teacher, Images("root"),
            Code(source.model_key)]


def run(ctx):
    cfg, e = ctx.cfg, ctx.cfg.export
    data = ctx.load_data()
    model_name, source = quantized_model(cfg.model, cfg.qat.source), QAT_SOURCES[cfg.qat.source]
    float_model, _ = ctx.load_model(source.stage, model_name, data, source.output)
    int8_model, qconfig = _rebuild_int8(ctx, model_name, data)
    runtimes = list(e.runtimes or default_runtimes())  # checked installed before anything was written
    ctx.begin()
    paths = _write_files(ctx, float_model, int8_model, qconfig, model_name, data)
    files, sizes = {k: os.path.basename(p) for k, p in paths.items()}, {k: os.path.getsize(p) for k, p in paths.items()}
    log.info("export: %s written; checking them on the %s validation images", ", ".join(files.values()),
             f"{len(data.val):,}")
    measured = measure_accuracy(float_model, int8_model, paths, eval_loader(data.val, cfg.train.eval_batch_size, 0, 1))
    stop_if_asked("after checking parity")
    log.info("export: timing the files in %s (batch %s)", ", ".join(runtimes),
             ", ".join(str(b) for b in e.latency_batch_sizes))
    float_layers = qconfig.get("float_layers", [])
    with BusyMeter() as meter:
        tables = {rt: latency_tables(paths, e.latency_batch_sizes, e.latency_threads, e.latency_repeats,
                                     e.latency_warmup, stop=stop_if_asked, runtime=rt) for rt in runtimes}
        speed, decided = verdict.decide(measured, tables[runtimes[0]], paths, files, sizes, float_layers, e,
                                        runtimes[0], stop_if_asked)
    busy = _cpus_busy(ctx, meter.busy)
    teacher = _teacher_latency(ctx, data, e, runtimes[0]) if source.stage != "teacher" else None
    if teacher:
        tables[runtimes[0]]["teacher"], sizes["teacher_onnx"] = teacher
    typed = export_report.typed_tables(tables)
    report = ExportReport(
        opset=e.opset, params=count_parameters(float_model), files=files, size_bytes=sizes,
        size_ratio_int8_fp32=round(sizes["int8"] / sizes["fp32"], 4), runtimes=typed, latency_ms=typed[runtimes[0]],
        speed=speed, float_layers=float_layers,
        checks=checks(measured["fp32"], measured["int8"], measured["int8_kernels"], e), verdict=decided,
        mixed_precision=_mixed_precision_figures(ctx), cpus_busy_while_timing=busy,
        teacher_file=ctx.state.sources["teacher:model"] if teacher else None,
        latency_protocol=dataclasses.asdict(protocol(e.latency_repeats, e.latency_warmup)), **measured)
    atomic_write_json(ctx.run.path(OUTPUTS["report"]), dataclasses.asdict(report))
    _fail_if_asked(ctx, report, e)
    metrics = verdict.manifest_metrics(report)
    shipped = next(kind for kind, name in files.items() if name == decided.file)
    near = verdict.near_chance(decided.file, _accuracy(report, shipped), data.num_classes)
    if near:
        log.warning("export: %s", near)
        metrics["near_chance"] = near
    return StageResult(metrics, [OUTPUTS[k] for k in (*paths, "report")], verdict.summary_line(report))


def _write_files(ctx, float_model, int8_model, qconfig, model_name, data):
    """The fp32, QAT int8 and (export.ptq) post-training int8 ONNX files, each with the deployment metadata;
    a Ctrl-C between files leaves whole files only."""
    e = ctx.cfg.export
    example = data.example()
    meta = deployment_metadata(model_name, data)
    paths = {"fp32": ctx.run.path(OUTPUTS["fp32"]), "int8": ctx.run.path(OUTPUTS["int8"])}
    source = QAT_SOURCES[ctx.cfg.qat.source]
    source_sha = ctx.input_sha256(source.stage, source.output)
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
    elif os.path.isfile(ctx.run.path(OUTPUTS["ptq"])):  # an earlier export's, of another model: never left beside
        os.remove(ctx.run.path(OUTPUTS["ptq"]))
        log.info("export: removed %s, an earlier export's (export.ptq is false now)", OUTPUTS["ptq"])
    return paths


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
    q = fx.read_qconfig(meta.get("qconfig"), path)
    example = data.example()
    model = fx.rebuild_int8(build_model(model_name, data.input_shape, data.num_classes), tensors, example, q, path)
    return model, q


def _cpus_busy(ctx, busy):
    """Cores other processes kept busy while the files were timed (said once, here and in the report, from
    verdict.BUSY on); not counted with several processes, whose other ranks wait for this one (NCCL's wait spins
    a core) and would be counted."""
    if busy is None or ctx.env.world > 1:
        return None
    busy = round(busy, 1)  # the figure export.json and the report keep: the log's warning follows the same one
    if busy >= verdict.BUSY:
        log.warning("export: %s", verdict.busy_note(busy, ctx.stage_path()))
    return busy


def _fail_if_asked(ctx, report, e):
    """A failed check fails the stage; so does an int8 file not fast enough under export.require_faster_int8.
    Every file is kept either way."""
    kept = f"files kept in {ctx.run.rel(ctx.stage_path())}/, figures in export.json"
    failed = [name for name, c in report.checks.items() if not c.ok]
    if failed:
        details = "; ".join(f"{n}: {report.checks[n].detail}" for n in failed)
        raise StageFailed(f"export: {len(failed)} check(s) failed - {details}; {kept}")
    if e.require_faster_int8 and not report.verdict.int8_faster:
        raise StageFailed(f"export: {report.verdict.why}; {kept} (export.require_faster_int8 is true: set it to false "
                          "to finish with the fp32 file as the one to deploy)")


def _teacher_latency(ctx, data, e, runtime):
    """The teacher's latency cells (its fp32 ONNX export, timed like every file, in the deciding runtime) and the
    export's size, for the report's comparison row; the file is not kept. None without a usable teacher."""
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
    log.info("export: timing the teacher (%s, exported to ONNX for this and not kept) for the report's comparison "
             "row", ctx.cfg.model.teacher)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "teacher.onnx")
        export_onnx(model, data.example(), path, e.opset, deployment_metadata(ctx.cfg.model.teacher, data))
        cells = latency_table(path, e.latency_batch_sizes, e.latency_threads, e.latency_repeats, e.latency_warmup,
                              stop=stop_if_asked, runtime=runtime)
        return cells, os.path.getsize(path)


ROW_NAMES = {"fp32": "fp32 ONNX", "int8": "int8 ONNX", "ptq": "int8 ONNX, post-training quantized, no QAT"}
OF_SOURCE = {"baseline": "the student trained alone's", "teacher": "the teacher's"}  # qat.source, but the default


def report_rows(entry, path):
    """The ONNX rows (fp32, QAT int8, PTQ int8), the one to deploy marked, and the teacher's latency (measured
    here, from its fp32 ONNX export) for its row."""
    run = os.path.dirname(os.path.dirname(path("report")))
    export = export_report.read(run)
    shipped = export_report.deployment_file(run, export.verdict.file, "verdict.file")
    runtime, rows = label(export.speed.runtime), []
    source = OF_SOURCE.get((entry.get("config") or {}).get("qat.source"))  # (a key of a section it reads part of)
    for kind in ("fp32", "int8", "ptq"):
        if kind not in export.latency_ms:
            continue
        b1, b64 = _latency_pair(export.latency_ms[kind])
        name = f"{source} {ROW_NAMES[kind]}" if source else ROW_NAMES[kind]
        rows.append({"id": f"{kind}_onnx", "artifact": f"{name} ({runtime})", "file": OUTPUTS[kind],
                     "params": entry["metrics"].get("params"), "size_bytes": export.size_bytes[kind],
                     "val_acc": _accuracy(export, kind), "latency_b1_ms": b1, "latency_b64_ms": b64,
                     "ship": os.path.basename(shipped) == export.files.get(kind), "record": OUTPUTS["report"]})
    if "teacher" in export.latency_ms and export.teacher_file:
        b1, b64 = _latency_pair(export.latency_ms["teacher"])
        rows.append({"id": "teacher", "latency_b1_ms": b1, "latency_b64_ms": b64, "measured_from": export.teacher_file,
                     "latency_of": f"its fp32 ONNX export in {runtime}", "record": OUTPUTS["report"]})
    return rows


def report_notes(entry, manifest=None, refresh="compress run"):
    """The verdict, how it was timed, what QAT bought over post-training quantization, int8 vs fp32 in every
    runtime, and a busy machine."""
    return verdict.report_notes(entry["metrics"])


def _accuracy(export, kind):
    return export.ptq.onnx_acc if kind == "ptq" else getattr(export, kind).onnx_acc


def _latency_pair(cells):
    """(batch-1, largest-batch) milliseconds on the most threads measured."""
    best = max(c.threads for c in cells)
    pick = {c.batch: c.ms for c in cells if c.threads == best}
    return pick.get(1), pick.get(max(pick))
