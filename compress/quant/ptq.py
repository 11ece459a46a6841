"""The peer of QAT that a user could run instead: onnxruntime's post-training static quantization (QDQ) of the
float student - minutes instead of a training stage. Quantized like the QAT file: uint8 activations over their
full observed range, int8 symmetric weights (per channel when qat.per_channel), the same layers kept in float,
calibrated on training images. The export stage measures it exactly as it measures the QAT file."""

import logging
import os
import tempfile

import numpy as np

from compress.quant.onnx_export import _trace, export_onnx, tidy


def module_of(node_name):
    """The module name (as in `named_modules`) of a node the TorchScript exporter named by its scopes:
    '/features/features.1/conv/conv.0/conv.0.0/Conv' -> 'features.1.conv.0.0'. Each scope is either a longer
    name of the one before (the same container, one level down) or a name relative to it."""
    parts, previous = [], None
    for scope in node_name.strip("/").split("/")[:-1]:
        if previous is not None and scope.startswith(previous + "."):
            parts[-1] = scope
        else:
            parts.append(scope)
        previous = scope
    return ".".join(parts)


class _Images:
    """onnxruntime's CalibrationDataReader over a float32 NCHW array, `batch` images at a time."""

    def __init__(self, images, batch=32):
        self.batches = iter([images[i:i + batch] for i in range(0, len(images), batch)])

    def get_next(self):
        x = next(self.batches, None)
        return None if x is None else {"input": np.ascontiguousarray(x, dtype=np.float32)}


def quantize_ptq(float_model, example, calibration, path, opset, per_channel, float_layers, metadata):
    """Write `path`: the float model exported to ONNX and quantized by onnxruntime (QDQ) from `calibration`
    (float32 NCHW images, already normalised), the layers in `float_layers` left float; cleaned like the QAT
    file and carrying `metadata`. Returns the names of the nodes kept float."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    named = tidy(_trace(float_model, example, path, opset), keep_node_names=True)  # constants folded: biases too
    keep = set(float_layers)
    excluded = [n.name for n in named.graph.node if n.name and module_of(n.name) in keep]
    with tempfile.TemporaryDirectory(prefix="compress-ptq-") as tmp:
        source, target = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "ptq.onnx")
        onnx.save(named, source)
        logging.disable(logging.WARNING)  # onnxruntime.quantization advises on the root logger while it works
        try:
            quantize_static(source, target, _Images(calibration), quant_format=QuantFormat.QDQ,
                            per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            nodes_to_exclude=excluded, calibrate_method=CalibrationMethod.MinMax,
                            extra_options={"ActivationSymmetric": False, "WeightSymmetric": True})
        finally:
            logging.disable(logging.NOTSET)
        quantized = onnx.load(target)
    export_onnx(None, None, path, opset, metadata, proto=tidy(quantized))
    return excluded
