"""FX quantization-aware training (compress.quant.fx): registry models prepared, trained and converted, layers
kept float, and int8 arithmetic exact on a wide depthwise convolution."""


import onnx
import pytest
import torch

from compress.models.registry import build_model
from compress.quant import fx as quant
from compress.quant.onnx_export import export_onnx


@pytest.mark.parametrize("name", [pytest.param("resnet18", marks=pytest.mark.e2e),  # ~5 s each
                                  pytest.param("quantizable_mobilenet_v2", marks=pytest.mark.e2e),
                                  "compact_cnn", "deep_cnn"])
def test_qat_prepares_trains_and_converts(name):
    """QAT on bigger registry models, on random data: prepare, a few steps, convert, int8 runs."""
    torch.manual_seed(0)
    model = build_model(name, (3, 32, 32), 10)
    prepared = quant.prepare(model, torch.randn(2, 3, 32, 32))
    opt = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(prepared(torch.randn(8, 3, 32, 32)), torch.randint(0, 10, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    quant.freeze_observers(prepared)
    quant.freeze_bn(prepared)
    int8 = quant.convert(prepared)
    x = torch.randn(4, 3, 32, 32)
    assert int8(x).shape == (4, 10)
    assert any("quantized" in type(m).__module__ for m in int8.modules()), "convert_fx produced no int8 modules"


def _int8_pair(tmp_path, name, shape, float_layers=()):
    from compress.quant import fx as quant

    torch.manual_seed(0)
    model = build_model(name, shape, 10).eval()
    example = torch.randn(2, *shape)
    export_onnx(model, example, tmp_path / "fp32.onnx", 21, {})
    prepared = quant.prepare(model, example, float_layers=float_layers)
    prepared.eval()
    with torch.no_grad():
        for _ in range(3):
            prepared(torch.randn(32, *shape))
    export_onnx(quant.convert(prepared), example, tmp_path / "int8.onnx", 21, {})
    return {k: str(tmp_path / f"{k}.onnx") for k in ("fp32", "int8")}


def test_a_layer_kept_float_stays_float_in_the_int8_file(tmp_path):
    paths = _int8_pair(tmp_path, "compact_cnn", (1, 28, 28), float_layers=["stem.0"])
    graph = onnx.load(paths["int8"]).graph
    first = next(n for n in graph.node if n.op_type == "Conv")
    weights = {i.name: i for i in graph.initializer}
    assert weights[first.input[1]].data_type == onnx.TensorProto.FLOAT  # the stem: float weights, no DQ
    assert any(i.data_type == onnx.TensorProto.INT8 for i in graph.initializer)


def test_torch_int8_matches_exact_arithmetic_on_a_wide_depthwise_convolution():
    """Full-range activations on x86: fbgemm's depthwise kernel was up to 70 steps off exact arithmetic for
    144 channels (what made torch int8 and onnxruntime disagree on mobilenet_v2); the engine quant.prepare
    picks must stay within one rounding step."""
    import torch.nn.functional as F
    from torch import nn

    from compress.quant import fx as quant

    torch.manual_seed(0)
    channels = 144
    model = nn.Sequential(nn.Conv2d(channels, channels, 1), nn.Conv2d(channels, channels, 3, padding=1,
                                                                      groups=channels, bias=False))
    x = torch.randn(8, channels, 8, 8)
    prepared = quant.prepare(model, x, "x86", "full", True).eval()
    with torch.no_grad():
        prepared(x)
    int8 = quant.convert(prepared)
    seen = {}
    depthwise = int8.get_submodule("1")
    depthwise.register_forward_hook(lambda module, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        int8(x)
        exact = F.conv2d(seen["x"].dequantize(), depthwise.weight().dequantize(), depthwise.bias(), 1, 1, 1, channels)
    expected = torch.quantize_per_tensor(exact, depthwise.scale, depthwise.zero_point, torch.quint8).int_repr().int()
    assert (seen["out"].int_repr().int() - expected).abs().max().item() <= 1, torch.backends.quantized.engine


def test_the_qconfig_record_read_back_is_checked_and_names_the_qat_configs_choices():
    """read_qconfig accepts describe_qconfig's record and refuses anything else in one CheckpointError; its
    choices are qat.backend's and qat.activation_range's."""
    import typing

    from compress.errors import CheckpointError
    from compress.run.config import QATConfig

    hints = typing.get_type_hints(QATConfig)
    assert quant.BACKENDS == typing.get_args(hints["backend"])
    assert quant.ACTIVATION_RANGES == typing.get_args(hints["activation_range"])
    good = {"backend": "qnnpack", "activation_range": "reduced", "per_channel": False, "float_layers": ["fc"]}
    assert quant.read_qconfig(good, "q.safetensors") == good
    for bad, words in [("{", "is not a JSON object"), ({**good, "per_channel": "yes"}, "has no per_channel"),
                       ({**good, "float_layers": "fc"}, "has float_layers that are not a list"),
                       ({**good, "float_layers": [1]}, "has float_layers that are not a list")]:
        with pytest.raises(CheckpointError, match=f"'q.safetensors' metadata 'qconfig' {words}"):
            quant.read_qconfig(bad, "q.safetensors")
