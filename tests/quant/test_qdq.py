"""The QDQ clean-up (compress.quant.qdq): no Cast inside a quantize/dequantize pair, ReLU6 as a clamp on the
integers, a float stem's max-pool kept on floats in onnxruntime."""

import numpy as np
import onnx
import torch

from compress.deploy.onnx_model import OnnxModel
from compress.quant.onnx_export import export_onnx


def _int8_file(model, x, tmp_path, opset, float_layers=()):
    """(torch int8 model, path of its exported ONNX file): `model` prepared (keeping `float_layers` float),
    calibrated on `x`, converted and exported the way the export stage does."""
    from compress.quant import fx as quant

    prepared = quant.prepare(model, x[:2], float_layers=float_layers).eval()
    with torch.no_grad():
        prepared(x)
    int8 = quant.convert(prepared)
    path = tmp_path / "int8.onnx"
    export_onnx(int8, x[:2], path, opset, {})
    return int8, path


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

    from compress.quant.verify import output_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).eval()
    x = torch.randn(16, 3, 12, 12) * 3
    int8, path = _int8_file(model, x, tmp_path, opset=21)
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


def _onnxruntime_graph(path, tmp_path):
    """The graph onnxruntime actually runs: its default optimizations applied, saved and loaded back (a GraphProto)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3  # the saved NCHWc graph is hardware-specific: expected, and only read here
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return onnx.load(tmp_path / "optimized.onnx").graph


def test_a_float_stems_max_pool_runs_in_float_in_onnxruntime(tmp_path):
    """A stem kept float (conv-bn-relu, max-pool) before int8 layers: onnxruntime moves a QuantizeLinear up across
    a MaxPool into a uint8 NCHW pool many times slower than the float one. The exported file must leave
    onnxruntime's own optimized graph with the pool on floats, and compute what torch's int8 model computes."""
    from torch import nn

    from compress.quant.verify import output_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.MaxPool2d(3, 2, 1),
                          nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).eval()
    x = torch.randn(16, 3, 24, 24)
    int8, path = _int8_file(model, x, tmp_path, opset=17, float_layers=["0"])
    shipped = onnx.load(path).graph
    assert [n.op_type for n in shipped.node][:4] == ["Conv", "MaxPool", "Relu", "QuantizeLinear"]
    graph = _onnxruntime_graph(path, tmp_path)
    producers = {out: node for node in graph.node for out in node.output}
    pools = [n for n in graph.node if "MaxPool" in n.op_type]
    assert pools and all(producers[p.input[0]].op_type != "QuantizeLinear" for p in pools), \
        [(n.op_type, [producers[i].op_type for i in n.input if i in producers]) for n in pools]
    runtime = OnnxModel(str(path), require_metadata=False)(x.numpy())
    with torch.no_grad():
        expected = int8(x).numpy()
    assert np.abs(runtime - expected).max() <= 2 * output_step(str(path))
