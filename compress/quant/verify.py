"""Is the ONNX file what PyTorch computed, and does it run int8 kernels: parity on the validation set (max |logit
difference|, scaled to the logits above 1, top-1 agreement, near-ties counted for int8), the kernels onnxruntime
runs after its QDQ fusions, and each file's correctness image by image, paired between files (exact McNemar) for
the verdict (compress.quant.verdict)."""

import dataclasses
import math

import numpy as np
import torch

from compress.deploy.export_report import Check, Paired, Parity, PostTraining
from compress.deploy.onnx_model import INT8_KERNELS, OnnxModel, optimized_op_types, read_onnx
from compress.training.paired import paired


def measure_accuracy(float_model, int8_model, paths, loader):
    """The fp32 and QAT int8 files against their PyTorch models on the validation set, the int8 kernels
    onnxruntime runs, the PTQ file's accuracy (it has no PyTorch counterpart), and each pair of files image by
    image: the ExportReport fields fp32, int8, int8_kernels, int8_optimized_ops, ptq and pairs."""
    fp32 = compare(float_model, OnnxModel(paths["fp32"]), loader)
    # Two int8 implementations round differently, and the differences add up through a deep network: a pick
    # within two steps of the int8 logits' resolution from torch's best is a tie, not a disagreement
    step = output_step(paths["int8"])
    int8 = compare(int8_model, OnnxModel(paths["int8"]), loader, tie=None if step is None else 2 * step)
    right = {"fp32": fp32.pop("correct"), "int8": int8.pop("correct")}
    ops = optimized_op_types(paths["int8"])
    out = {"fp32": Parity(**fp32), "int8": Parity(**int8), "int8_optimized_ops": ops,
           "int8_kernels": {op: n for op, n in ops.items() if op in INT8_KERNELS}, "ptq": None}
    if "ptq" in paths:
        right["ptq"] = onnx_correct(OnnxModel(paths["ptq"]), loader)
        out["ptq"] = PostTraining(
            onnx_acc=100.0 * float(right["ptq"].mean()) if len(right["ptq"]) else 0.0,
            vs_qat=Paired(**paired(right["int8"], right["ptq"])),  # only_first: QAT alone right; only_second: PTQ
            int8_kernels={op: n for op, n in optimized_op_types(paths["ptq"]).items() if op in INT8_KERNELS})
    out["pairs"] = {f"fp32_vs_{kind}": Paired(**paired(right["fp32"], right[kind])) for kind in right if kind != "fp32"}
    return out


def onnx_correct(onnx_model, loader):
    """Whether an ONNX file's top-1 pick is right, per image of a labelled loader (a bool array)."""
    return np.concatenate([onnx_model(x.numpy()).argmax(1) == y.numpy() for x, y, *_ in loader] or
                          [np.zeros(0, dtype=bool)])


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
    diff = np.abs(expected - got)
    # float32 rounding grows with the numbers: each image's difference against its largest |logit| (when above 1)
    scale = np.maximum(np.abs(expected).max(1), 1.0)
    return {"correct": picked == labels,  # per image (not JSON: a caller pairs it with another file's, then drops it)
            "max_abs_diff": float(diff.max()), "max_abs_logit": float(np.abs(expected).max()),
            "max_scaled_diff": float((diff.max(1) / scale).max()),
            "top1_agreement": float((expected.argmax(1) == picked).mean()), "top1_within_tie": float(within.mean()),
            "tie": tie, "torch_acc": 100.0 * float((expected.argmax(1) == labels).mean()),
            "onnx_acc": 100.0 * float((picked == labels).mean()), "samples": len(labels)}


def output_step(path):
    """The quantization step of an int8 model's logits (the scale of the DequantizeLinear that produces the
    graph output), or None when the logits come out of a layer kept in float."""
    from onnx import numpy_helper

    graph = read_onnx(path).graph
    consts = {t.name: t for t in graph.initializer}
    producer = next((n for n in graph.node if graph.output[0].name in n.output), None)
    if producer is None or producer.op_type != "DequantizeLinear" or producer.input[1] not in consts:
        return None
    scale = numpy_helper.to_array(consts[producer.input[1]])
    return float(scale) if scale.size == 1 else None


def checks(fp32, int8, int8_kernels, e):
    """The stage's three checks ({name: Check}): fp32 parity, int8 parity and int8 kernels, each with its figures
    against the limits and, failed, what to change."""
    fp32, int8 = dataclasses.asdict(fp32), dataclasses.asdict(int8)
    out = {
        "fp32_parity": {"ok": (fp32["max_scaled_diff"] <= e.fp32_max_abs_diff
                               and fp32["top1_agreement"] >= e.fp32_min_agreement),
                        "detail": f"max |diff| {fp32['max_abs_diff']:.2e} with logits up to "
                                  f"{fp32['max_abs_logit']:.3g}, {fp32['max_scaled_diff']:.2e} of an image's largest "
                                  f"(limit {e.fp32_max_abs_diff:g}), top-1 agreement {fp32['top1_agreement']:.4f} "
                                  f"(min {e.fp32_min_agreement})"},
        "int8_parity": {"ok": int8["top1_within_tie"] >= e.int8_min_agreement,
                        "detail": f"top-1 agreement with torch int8 {int8['top1_within_tie']:.4f} counting picks "
                                  f"within {int8['tie']:.3g} (2 steps of 8-bit logits) of torch's best as ties, exact "
                                  f"{int8['top1_agreement']:.4f} (min {e.int8_min_agreement}), "
                                  f"max |diff| {int8['max_abs_diff']:.3f}"},
        "int8_kernels": {"ok": bool(int8_kernels),
                         "detail": "onnxruntime runs " + (", ".join(int8_kernels) or
                                                          "no int8 kernels after optimisation: the model has no layer "
                                                          "onnxruntime runs in int8: if qat.float_layers "
                                                          "keeps layers float, --set 'qat.float_layers=[]' and rerun "
                                                          "qat; if not, onnxruntime has no int8 kernel for this "
                                                          "model's layers - deploy model.fp32.onnx")},
    }
    if not out["fp32_parity"]["ok"] and not math.isfinite(fp32["max_scaled_diff"]):
        out["fp32_parity"]["detail"] += ("; the logits are not finite (NaN or inf): the float student itself is "
                                         "broken - retrain it more gently (a lower distill.lr)")
    elif not out["fp32_parity"]["ok"]:  # an exporter difference, or a tolerance too tight for this model
        out["fp32_parity"]["detail"] += (f"; try another opset (--set export.opset=17), or accept it with --set "
                                         f"export.fp32_max_abs_diff={_above(fp32['max_scaled_diff'])}")
    if not out["int8_parity"]["ok"]:
        out["int8_parity"]["detail"] += (f"; accept it with --set export.int8_min_agreement="
                                         f"{math.floor(int8['top1_within_tie'] * 100) / 100:g}")
    return {name: Check(**c) for name, c in out.items()}


def _above(value):
    """A round number above `value` (a tolerance to suggest)."""
    exponent = math.floor(math.log10(value)) if value > 0 else -6
    return f"{math.ceil(value / 10 ** exponent) * 10 ** exponent:g}"
