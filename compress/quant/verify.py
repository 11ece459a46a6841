"""Is the ONNX file what PyTorch computed, does it run int8 kernels, and is it faster: parity on the
validation set (max |logit difference|, scaled to the logits above 1, top-1 agreement, near-ties counted for
int8), the kernels onnxruntime runs after its QDQ fusions, and the int8-vs-fp32 speed gate measured interleaved
on real images."""

import math

import numpy as np
import torch

from compress.cpus import usable_cpus
from compress.deploy.latency import compare_latency, speedup_text
from compress.deploy.onnx_model import read_onnx
from compress.deploy.runtimes import compare_in_openvino, onnxruntime_session
from compress.training.paired import p_text


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


def checks(report, e):
    fp32, int8 = report["fp32"], report["int8"]
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
        "int8_kernels": {"ok": bool(report["int8_kernels"]),
                         "detail": "onnxruntime runs " + (", ".join(report["int8_kernels"]) or
                                                          "no int8 kernels after optimisation: the model has no layer "
                                                          "onnxruntime runs in int8 - check qat.float_layers")},
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
    return out


def _above(value):
    """A round number above `value` (a tolerance to suggest)."""
    exponent = math.floor(math.log10(value)) if value > 0 else -6
    return f"{math.ceil(value / 10 ** exponent) * 10 ** exponent:g}"


def int8_choice(report):
    """Which int8 file the verdict weighs against fp32: the QAT file ("int8"), unless onnxruntime's post-training
    quantization of the same float model ("ptq") gets more validation images right beyond noise (the exact
    McNemar test of `paired`, p < 0.05) and runs int8 kernels - then QAT cost accuracy, and the PTQ file is the
    better int8 model."""
    ptq = report.get("ptq") or {}
    pair = ptq.get("vs_qat")
    if pair and ptq.get("int8_kernels") and pair["p"] < 0.05 and pair["only_second"] > pair["only_first"]:
        return "ptq"
    return "int8"


def verdict(speed, sizes, accuracy, float_layers, e, int8_file="model.int8.onnx", ptq=None):
    """Which file to deploy and why, in one sentence with the figures: the int8 file when it is at least
    export.min_int8_speedup times faster than fp32 in the deciding runtime, else fp32 (with what int8 still
    offers: its size). `speed` is speed_gate's result for `int8_file`, `sizes` and `accuracy` map "fp32"/"int8"
    to bytes and % (the int8 entries: `int8_file`'s). `ptq`: when `int8_file` is the post-training quantized one,
    `paired`'s result of QAT against it - the reason it replaced the QAT file."""
    ratio, rt = speed["speedup"], speed["runtime"]
    timing = (f"batch {speed['batch']}, {speed['threads']} threads in {rt}: int8 {speed['int8_ms']:.2f} ms vs fp32 "
              f"{speed['fp32_ms']:.2f} ms")
    smaller = sizes["fp32"] / sizes["int8"]
    accuracies = f"validation accuracy int8 {accuracy['int8']:.2f}% vs fp32 {accuracy['fp32']:.2f}%"
    which_int8 = ""
    if ptq:
        which_int8 = (f"the int8 file is the post-training quantized one: it gets {ptq['only_second']} validation "
                      f"images right that the QAT file gets wrong, and {ptq['only_first']} the other way round "
                      f"(McNemar p {p_text(ptq['p'])}), so QAT cost accuracy here; ")
    if ratio >= e.min_int8_speedup:
        why = (f"{which_int8}int8 is {speedup_text(ratio)} than fp32 ({timing}) and {smaller:.1f}x smaller; "
               f"{accuracies}")
        return {"deploy": "int8", "file": int8_file, "runtime": rt, "int8_faster": True, "why": why}
    kept = f" even with {', '.join(float_layers)} kept in float" if float_layers else ""
    which = "the faster one" if ratio < 1 else "the one"
    advice = ("To make int8 pay: keep more layers in float (qat.float_layers), or choose a student with more "
              "channels per layer" if ratio < 1 else
              f"int8 is faster, by less than the {e.min_int8_speedup:g}x export.min_int8_speedup asks: lower it to "
              "deploy the int8 file")
    why = (f"{which_int8}int8 is {speedup_text(ratio)} than fp32{kept} ({timing}; needed {e.min_int8_speedup:g}x), "
           f"so the fp32 file is {which} to deploy; the int8 file is still {smaller:.1f}x smaller, if size matters "
           f"more than speed; {accuracies}. {advice}")
    return {"deploy": "fp32", "file": "model.fp32.onnx", "runtime": rt, "int8_faster": False, "why": why}


def speed_gate(paths, images, e, stop=None, runtime="onnxruntime"):
    """int8 vs fp32 at the largest latency batch on all cores, on real validation images, interleaved in
    rounds, in `runtime`; the ratio of the two minima (the estimate least disturbed by other processes). A
    ratio below export.min_int8_speedup is measured once more, longer, before it decides the verdict."""
    batch, threads = len(images), usable_cpus()
    x = images.numpy()
    pair = {k: paths[k] for k in ("fp32", "int8")}
    models = {k: onnxruntime_session(p, threads) for k, p in pair.items()} if runtime == "onnxruntime" else None
    attempts = []
    for rounds in (5, 11):
        if models is None:  # OpenVINO, in a child process of its own
            if stop:
                stop()
            times = compare_in_openvino(pair, x, threads, rounds)
        else:
            times = compare_latency(models, x, rounds=rounds, stop=stop)
        attempts.append({"rounds": rounds, "fp32_ms": round(times["fp32"]["min_ms"], 4),
                         "int8_ms": round(times["int8"]["min_ms"], 4),
                         "fp32_median_ms": round(times["fp32"]["median_ms"], 4),
                         "int8_median_ms": round(times["int8"]["median_ms"], 4)})
        if attempts[-1]["fp32_ms"] / attempts[-1]["int8_ms"] >= e.min_int8_speedup:
            break
    best = max(attempts, key=lambda a: a["fp32_ms"] / a["int8_ms"])
    speedup = best["fp32_ms"] / best["int8_ms"]
    return {"runtime": runtime, "batch": batch, "threads": threads, "speedup": round(speedup, 4),
            "min_speedup": e.min_int8_speedup,
            "fp32_ms": best["fp32_ms"], "int8_ms": best["int8_ms"], "attempts": attempts}
