"""The QDQ clean-up (compress.quant.qdq): no Cast inside a quantize/dequantize pair, ReLU6 as a clamp on the
integers."""

import numpy as np
import onnx
import torch

from compress.deploy.onnx_model import OnnxModel
from compress.quant.onnx_export import export_onnx


def test_int8_graph_is_clean_qdq_without_casts(finished_run):
    """No Cast between QuantizeLinear and DequantizeLinear: the pair other runtimes pattern-match stays whole."""
    graph = onnx.load(finished_run / "export" / "model.int8.onnx").graph
    producers = {out: node for node in graph.node for out in node.output}
    assert not [n for n in graph.node if n.op_type == "Cast"]
    dequantized = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in producers]
    assert dequantized and all(producers[n.input[0]].op_type == "QuantizeLinear" for n in dequantized)


def test_relu6_between_int8_layers_clamps_the_integers(tmp_path):
    """ReLU6 (mobilenets) exports as Q -> DQ -> Clip -> Q with one set of parameters; it must ship as a clamp on
    the uint8 values (Q -> Clip), which computes the same numbers without three float passes."""
    from onnx.reference import ReferenceEvaluator
    from torch import nn

    from compress.quant import fx as quant
    from compress.quant.verify import output_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).eval()
    x = torch.randn(16, 3, 12, 12) * 3
    prepared = quant.prepare(model, x[:2]).eval()
    with torch.no_grad():
        prepared(x)
    int8 = quant.convert(prepared)
    path = tmp_path / "int8.onnx"
    export_onnx(int8, x[:2], path, 21, {})
    graph = onnx.load(path).graph
    producers = {out: node for node in graph.node for out in node.output}
    clips = [n for n in graph.node if n.op_type == "Clip"]
    assert len(clips) == 2 and all(producers[c.input[0]].op_type == "QuantizeLinear" for c in clips)
    runtime = OnnxModel(str(path), require_metadata=False)(x.numpy())
    reference = ReferenceEvaluator(onnx.load(path)).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        expected = int8(x).numpy()
    assert np.array_equal(runtime, reference)
    assert output_step(str(path)) is not None
    assert np.abs(runtime - expected).max() <= 2 * output_step(str(path))
