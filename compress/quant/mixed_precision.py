"""Latency-aware mixed precision: which layers of the student to keep in float because their int8 form costs
more than it saves - decided *before* QAT from onnxruntime measurements, so that fake-quant training matches
the exported model.

Each candidate is the real export path without training: prepare with the layers in question kept float
(QConfigMapping.set_module_name(name, None)), calibrate the observers on a few validation batches, convert,
export, and time with onnxruntime on real validation images, interleaved with the current best (min of
several rounds: the least noise-prone estimate on a shared machine). Greedy from "every layer int8": try
keeping float the stem (a first convolution on few channels), the classifier, and the depthwise convolutions;
a group stays float only when the whole model gets faster by more than `margin`; a kept stem grows into a
longer float prefix while that keeps paying. A trial that would leave no layer in int8 is not tried: the int8 file
must hold int8 layers (export checks it), and whether int8 pays at all is the export verdict's call.
"""

import copy
import logging
import os
import tempfile

import torch
from torch import nn

from compress.deploy.latency import compare_latency
from compress.deploy.onnx_model import OnnxModel
from compress.errors import StageFailed
from compress.quant import fx
from compress.quant.onnx_export import export_onnx

log = logging.getLogger(__name__)


def quantizable_layers(model):
    """Names of the Conv2d / Linear modules (the layers that get int8 weights), in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def covered(float_layers, layers):
    """The names in `layers` that `float_layers` keeps float: a layer itself, or a module it sits in."""
    return [n for n in layers if any(n == f or n.startswith(f + ".") for f in float_layers)]


def candidate_groups(model):
    """[(label, [layer names])] to try keeping float, cheapest-to-keep first."""
    layers = quantizable_layers(model)
    modules = dict(model.named_modules())
    groups = [("stem", layers[:1]), ("classifier", layers[-1:])]
    depthwise = [n for n in layers if isinstance(modules[n], nn.Conv2d) and modules[n].groups > 1
                 and modules[n].groups == modules[n].in_channels]
    if depthwise:
        groups.append(("depthwise convolutions", depthwise))
    return [(label, g) for label, g in groups if g], layers


class Timer:
    """int8 candidates of one float model, built and timed the way the export stage will ship them."""

    def __init__(self, float_model, calibration, timing_batch, qcfg, threads, opset=17):
        self.float_model, self.calibration, self.x = float_model, calibration, timing_batch.numpy()
        self.qcfg, self.threads, self.opset = qcfg, threads, opset
        self.tmp = tempfile.TemporaryDirectory(prefix="compress-mixed-")
        self.sessions = {}

    def session(self, float_layers):
        key = tuple(sorted(float_layers))
        if key not in self.sessions:
            path = os.path.join(self.tmp.name, f"c{len(self.sessions)}.onnx")
            model = self.float_model if key == ("<all>",) else self._int8(list(key))
            export_onnx(model, self.calibration[0][:2], path, self.opset, {})
            self.sessions[key] = OnnxModel(path, threads=self.threads, require_metadata=False)
        return self.sessions[key]

    def _int8(self, float_layers):
        q = self.qcfg
        torch.manual_seed(0)
        prepared = fx.prepare(copy.deepcopy(self.float_model), self.calibration[0][:2], q.backend,
                                 q.activation_range, q.per_channel, float_layers)
        prepared.eval()
        with torch.no_grad():
            for x in self.calibration:
                prepared(x)
        return fx.convert(prepared)

    def compare(self, *choices, rounds=5):
        """{choice: best ms} for float-layer choices ("<all>" = the float model), measured interleaved."""
        models = {i: self.session(c) for i, c in enumerate(choices)}
        times = compare_latency(models, self.x, rounds=rounds)
        return [times[i]["min_ms"] for i in range(len(choices))]

    def close(self):
        self.tmp.cleanup()


class Unexportable(StageFailed):
    """The fp32 or the all-int8 model does not export to ONNX: no choice of float layers is worth timing."""


def choose_float_layers(timer, model, margin=0.05, stop=None):
    """(float layer names, figures) - the greedy choice described in the module docstring."""
    groups, layers = candidate_groups(model)
    try:
        fp32_ms, best_ms = timer.compare(("<all>",), ())
    except StageFailed as error:  # the export stage would fail the same way, after the training
        raise Unexportable(str(error)) from None
    figures = {"fp32_ms": round(fp32_ms, 4), "all_int8_ms": round(best_ms, 4), "tried": []}
    chosen = []
    for label, group in groups:
        if stop:
            stop()
        trial = sorted(set(chosen) | set(group))
        if len(trial) >= len(layers):
            figures["tried"].append({"float": label, "layers": group, "kept_float": False,
                                     "skipped": "it would leave no layer in int8"})
            continue
        current_ms, trial_ms = timer.compare(tuple(chosen), tuple(trial))
        kept = trial_ms < current_ms * (1 - margin)
        figures["tried"].append({"float": label, "layers": group, "int8_ms": round(current_ms, 4),
                                 "with_float_ms": round(trial_ms, 4), "kept_float": kept})
        if kept:
            chosen, best_ms = trial, trial_ms
            if label == "stem":
                chosen, best_ms = _grow_prefix(timer, layers, chosen, best_ms, margin, figures)
    figures["chosen_ms"] = round(best_ms, 4)
    return chosen, figures


def _grow_prefix(timer, layers, chosen, best_ms, margin, figures):
    """With the stem float, the next layers may be cheaper in float too: extend the float prefix while it pays."""
    for layer in layers[1:-1]:
        if layer in chosen:
            continue
        trial = sorted(set(chosen) | {layer})
        if len(trial) >= len(layers):
            break
        current_ms, trial_ms = timer.compare(tuple(chosen), tuple(trial))
        kept = trial_ms < current_ms * (1 - margin)
        figures["tried"].append({"float": f"prefix up to {layer}", "layers": [layer], "int8_ms": round(current_ms, 4),
                                 "with_float_ms": round(trial_ms, 4), "kept_float": kept})
        if not kept:
            break
        chosen, best_ms = trial, trial_ms
    return chosen, best_ms


def timed_choice(float_model, images, batch, threads, q, opset, model_name, stop):
    """(float layer names, figures) of the latency-aware choice (`choose_float_layers`) for the qat stage: the
    int8 candidates calibrated on `images` and timed on its first `batch` in onnxruntime on `threads`, said in the
    log with the rule and the setting that fixes the choice. A model that does not export once quantized fails
    the stage now (export would, after QAT); a candidate that does not export quantizes every layer."""
    from compress.deploy.latency import speedup_text
    from compress.deploy.timing import threads_text

    log.info("qat: timing int8 candidates in onnxruntime (batch %d) to choose the layers kept in float; "
             "--set 'qat.float_layers=[]' skips this", batch)
    timer = Timer(float_model, list(images.split(32)), images[:batch], q, threads=threads, opset=opset)
    try:
        layers, figures = choose_float_layers(timer, float_model, stop=stop)
    except Unexportable as error:
        raise StageFailed(f"qat: {model_name} does not export to ONNX once quantized "
                          f"({str(error).removeprefix('export: ')}), so the export stage would fail after QAT; choose "
                          "another model (ResNets, MobileNets, EfficientNets and RegNets export)") from None
    except StageFailed as error:  # a candidate that does not export: quantize everything, as asked by default
        log.warning("qat: could not time the int8 candidates (%s); quantizing every layer", error)
        return [], {"mode": "all int8 (timing failed)"}
    finally:
        timer.close()
    figures = {"mode": f"latency-aware (batch {batch}, {threads_text(threads)})", "runtime": "onnxruntime",
               **figures}
    tried = "; ".join(f"{t['float']} stays int8: {t['skipped']}" if "skipped" in t else
                      f"{t['float']} float {t['with_float_ms']:.2f} ms vs int8 {t['int8_ms']:.2f} ms "
                      f"({'kept float' if t['kept_float'] else 'stays int8'})" for t in figures["tried"])
    slower = figures["chosen_ms"] > figures["fp32_ms"] and not layers
    ratio = (speedup_text(figures["fp32_ms"] / figures["all_int8_ms"]) + " than fp32"
             if figures["all_int8_ms"] else "n/a")
    log.info("qat: with every layer int8 the student is %s in onnxruntime; kept float: %s - a layer stays float only "
             "where that makes the student at least 5%% faster, so one a little faster in float stays int8 (%s)%s; a "
             "choice made from timings, which a busy machine can change: --set 'qat.float_layers=[%s]' fixes it",
             ratio, ", ".join(layers) or "none", tried,
             "; no group of layers kept in float paid 5%, and int8 stays slower than fp32: export will measure the "
             "files again and recommend fp32 if it still is" if slower else "", ",".join(layers))
    return layers, figures
