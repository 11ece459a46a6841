"""export/export.json: its schema, and reading it back.

The dataclasses below are the schema: their fields are the file's keys (the export stage writes an ExportReport
with dataclasses.asdict), and each field's docstring says what it holds. `read` turns the file back into them,
naming the key of anything missing or of the wrong type in one sentence; a field added since an earlier version
has a default, so a run directory that version finished still reads. A deployment follows the verdict's file
only inside the run's export/ folder (`deployment_file`)."""

import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import Optional

from compress.errors import InputError
from compress.fileio import read_json

FILE = "export.json"


@dataclass
class Parity:
    """An ONNX file against its PyTorch model, image by image on the validation set."""

    max_abs_diff: float
    """largest |ONNX logit - PyTorch logit|"""
    max_abs_logit: float
    """largest |PyTorch logit| (float32 rounding grows with it)"""
    max_scaled_diff: float
    """largest difference divided by its image's largest |logit| (when above 1): what export.fp32_max_abs_diff limits"""
    top1_agreement: float
    """share of images whose top-1 class is the same in both"""
    top1_within_tie: float
    """the same, counting a pick within `tie` of PyTorch's best logit as agreeing (a near-tie rounding may break)"""
    tie: float
    """the logit margin counted as a tie (int8: two steps of the logits' 8-bit resolution; fp32: 0)"""
    torch_acc: float
    """validation accuracy of the PyTorch model, %"""
    onnx_acc: float
    """validation accuracy of the ONNX file in onnxruntime, %"""
    samples: int
    """validation images compared"""


@dataclass
class Paired:
    """Two files compared image by image (compress.training.paired): only the images they disagree on count."""

    only_first: int
    """images only the first file gets right"""
    only_second: int
    """images only the second file gets right"""
    p: float
    """exact two-sided McNemar p: below 0.05, the accuracies differ beyond noise"""


@dataclass
class PostTraining:
    """model.ptq.onnx: onnxruntime's post-training quantization of the same float model (export.ptq)."""

    onnx_acc: float
    """validation accuracy, %"""
    vs_qat: Paired
    """the QAT file (first) against this one (second)"""
    int8_kernels: dict[str, int]
    """int8 kernels onnxruntime runs in it after its QDQ fusions, with their counts"""


@dataclass
class LatencyCell:
    """One file timed in one cell of a latency table (compress.deploy.timing: interleaved rounds)."""

    batch: int
    """images per call"""
    threads: int
    """the runtime's intra-op threads"""
    ms: float
    """milliseconds a call: the median over the rounds of each round's fastest call - the figure the report, the
    verdict and bench show (export.json files without `round_ms` hold the median of every call here)"""
    images_per_s: float
    """batch / ms"""
    round_ms: Optional[list[float]] = None
    """each interleaved round's fastest call (absent from export.json files written before it was, like the fields
    below: readers take them as optional)"""
    median_ms: Optional[float] = None
    """the median of every timed call: above `ms` by what other processes took"""
    min_ms: Optional[float] = None
    """the fastest call"""
    runs: Optional[int] = None
    """timed calls"""


@dataclass
class Attempt:
    """One measurement of the verdict's cell: the table's, and a longer one when int8 fell short."""

    rounds: int
    """interleaved rounds"""
    fp32_ms: float
    """the fp32 file's figure in the cell"""
    int8_ms: float
    """the int8 file's figure in the cell"""


@dataclass
class Speed:
    """The int8 file the verdict weighed against fp32, in the deciding runtime's deciding cell."""

    runtime: str
    """the first of export.runtimes: it decides"""
    batch: int
    """the largest of export.latency_batch_sizes"""
    threads: int
    """the most threads timed: every usable core, or the most of export.latency_threads"""
    speedup: float
    """fp32 ms / int8 ms"""
    min_speedup: float
    """export.min_int8_speedup: the speed-up int8 needs to be deployed"""
    fp32_ms: float
    """the fp32 file's figure: the table's cell"""
    int8_ms: float
    """the int8 file's figure: the table's cell"""
    attempts: list[Attempt]
    """the measurements, the last one deciding"""
    int8_file: str = "model.int8.onnx"
    """the int8 file weighed: QAT's, or the post-training quantized one when the verdict preferred it"""


@dataclass
class Check:
    ok: bool
    """whether the check passed"""
    detail: str
    """the figures against the limits, and what to change when it failed"""


@dataclass
class Candidate:
    """One file the verdict weighed."""

    kind: str
    """fp32, int8 (QAT) or ptq"""
    file: str
    """its file name in export/"""
    accuracy: float
    """validation accuracy, %"""
    ms: float
    """its latency in the deciding cell (the table's figure)"""
    size_bytes: int
    """its size"""


@dataclass
class Verdict:
    """Which file to deploy, and why."""

    deploy: str
    """int8 or fp32"""
    file: str
    """the file to deploy: a file name in the run's export/ folder"""
    runtime: str
    """the runtime whose timings decided"""
    int8_faster: bool
    """whether the int8 file weighed is export.min_int8_speedup times faster than fp32"""
    why: str
    """the reason, in one sentence with the figures"""
    candidates: Optional[list[Candidate]] = None
    """every file weighed (optional: absent from export.json files written before it was)"""


@dataclass
class ExportReport:
    """export/export.json."""

    opset: int
    """the ONNX opset of every file (export.opset)"""
    params: int
    """parameters of the float model"""
    files: dict[str, str]
    """{fp32, int8, ptq}: their file names in export/"""
    size_bytes: dict[str, int]
    """bytes of each file (and teacher_onnx: the teacher's fp32 ONNX export, not kept)"""
    size_ratio_int8_fp32: float
    """model.int8.onnx's size over model.fp32.onnx's"""
    fp32: Parity
    """model.fp32.onnx against the float PyTorch model"""
    int8: Parity
    """model.int8.onnx against the converted int8 PyTorch model"""
    int8_kernels: dict[str, int]
    """int8 kernels onnxruntime runs in model.int8.onnx"""
    int8_optimized_ops: dict[str, int]
    """every op of model.int8.onnx's graph as onnxruntime runs it"""
    runtimes: dict[str, dict[str, list[LatencyCell]]]
    """{runtime: {fp32/int8/ptq/teacher: cells}}, the deciding runtime first"""
    latency_ms: dict[str, list[LatencyCell]]
    """the deciding runtime's tables: the report's latency columns"""
    speed: Speed
    """the int8 file weighed against fp32 in the deciding cell"""
    float_layers: list[str]
    """layers QAT kept in float"""
    checks: dict[str, Check]
    """fp32_parity, int8_parity, int8_kernels: a failed one fails the stage"""
    verdict: Verdict
    """the file to deploy, and why"""
    ptq: Optional[PostTraining] = None
    """absent with export.ptq false"""
    pairs: Optional[dict[str, Paired]] = None
    """fp32_vs_int8, fp32_vs_ptq: the fp32 file (first) against each int8 file, image by image"""
    mixed_precision: Optional[dict] = None
    """QAT's latency-aware choice of float layers, as the qat stage recorded it"""
    cpus_busy_while_timing: Optional[float] = None
    """cores other processes kept busy while the files were timed (one process only): from 0.5 on, the report says the
    latencies are noisy"""
    teacher_file: Optional[str] = None
    """the teacher checkpoint whose fp32 ONNX export was timed for the report's teacher row"""
    latency_protocol: Optional[dict] = None
    """how every cell was timed (compress.deploy.timing.Protocol)"""


def report_path(run):
    return os.path.join(run, "export", FILE)


def read(run, part=None):
    """The run's export.json as an ExportReport (or only its `part`, e.g. "verdict": a deployment reads no more
    than it follows); one sentence naming the file and key for anything missing or of the wrong type."""
    path = report_path(run)
    data = read_json(path, "export report")
    if not isinstance(data, dict):
        raise InputError(f"{path} is not an export report (a JSON {_json_kind(data)}, not a mapping); {_redo(run)}")
    if part is None:
        return _convert(ExportReport, data, "", path, run)
    if part not in data:
        raise InputError(f"{path}: {part} is missing; {_redo(run)}")
    return _convert(typing.get_type_hints(ExportReport)[part], data[part], part, path, run)


def deployment_file(run, name, key):
    """The path of `name`, an ONNX file the run's export.json names under `key`, strictly inside the run's
    export/ folder: a bare file name ending in .onnx, not a link; anything else is refused."""
    folder = os.path.join(run, "export")
    path = os.path.join(folder, name)
    if (os.path.isabs(name) or os.path.basename(name) != name or name in (".", "..") or "/" in name or "\\" in name
            or os.path.dirname(os.path.normpath(path)) != os.path.normpath(folder)):
        raise InputError(f"{report_path(run)}: {key} {name!r} is not a file name inside {folder}/; {_redo(run)}")
    if not name.endswith(".onnx"):
        raise InputError(f"{report_path(run)}: {key} {name!r} is not an ONNX file (.onnx); {_redo(run)}")
    if os.path.islink(path):
        raise InputError(f"{report_path(run)}: {key} {name!r} is a link to {os.readlink(path)!r}, not a file of the "
                         f"run; {_redo(run)}")
    if not os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep):
        raise InputError(f"{report_path(run)}: {key} {name!r} lies outside {folder}/; {_redo(run)}")
    return path


def _redo(run):
    return f"rerun `compress run --run-dir {run} --stages export --force` to write it again"


def _convert(tp, value, key, path, run):
    """`value` as type `tp` (a dataclass of this module, Optional, list, dict[str, X], or a scalar)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _wrong(key, "a mapping", value, path, run)
        hints, out = typing.get_type_hints(tp), {}
        for f in dataclasses.fields(tp):
            where = f"{key}.{f.name}" if key else f.name
            if f.name in value:
                out[f.name] = _convert(hints[f.name], value[f.name], where, path, run)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise InputError(f"{path}: {where} is missing; {_redo(run)}")
        return tp(**out)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)][0]
        return None if value is None else _convert(inner, value, key, path, run)
    if origin is list:
        if not isinstance(value, list):
            raise _wrong(key, "a list", value, path, run)
        return [_convert(args[0], v, f"{key}[{i}]", path, run) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _wrong(key, "a mapping", value, path, run)
        return {k: _convert(args[1], v, f"{key}.{k}", path, run) for k, v in value.items()} if args else value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise _wrong(key, {str: "text", int: "a whole number", bool: "true or false", float: "a number"}.get(tp, tp),
                 value, path, run)


def _wrong(key, what, value, path, run):
    shown = repr(value) if not isinstance(value, (dict, list)) else f"a JSON {_json_kind(value)}"
    return InputError(f"{path}: {key} must be {what}, got {shown[:80]}; {_redo(run)}")


def _json_kind(value):
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value),
                                                                                                  "number")


def typed_tables(tables):
    """{runtime: {name: [cell dict]}} as the schema's LatencyCells."""
    return {rt: {name: [LatencyCell(**c) for c in cells] for name, cells in t.items()} for rt, t in tables.items()}
