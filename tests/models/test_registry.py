import pytest
import torch
from torch.fx import symbolic_trace

from compress.models.registry import DESCRIPTIONS, MODELS, build_model
from compress.quant import fx as quant


def test_every_model_is_described():
    assert set(MODELS) == set(DESCRIPTIONS)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_every_model_adapts_to_input_and_is_fx_traceable(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, num_classes=7).eval()
    x = torch.randn(2, *shape)
    assert model(x).shape == (2, 7)
    traced = symbolic_trace(model)
    assert torch.allclose(traced(x), model(x))


@pytest.mark.parametrize("name", ["resnet18", "quantizable_mobilenet_v2", "compact_cnn", "deep_cnn"])
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


def test_qat_distils_from_an_untouched_frozen_copy_of_the_float_model():
    """The target of QAT's distillation term is the float model as it was before prepare_qat_fx edited it (fused
    BN, observers) and before any QAT step: a copy that shared modules with the prepared model would drift with
    it and teach nothing."""
    from stages.qat import _frozen_copy

    torch.manual_seed(0)
    model = build_model("compact_cnn", (3, 32, 32), 10)
    x = torch.randn(8, 3, 32, 32)
    reference = _frozen_copy(model)
    before = model.eval()(x).detach()
    prepared = quant.prepare(model.train(), x[:2])
    opt = torch.optim.SGD(prepared.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        prepared(x).sum().backward()
        opt.step()
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    assert torch.equal(reference(x), before)
    assert not torch.allclose(prepared.eval()(x), before, atol=1e-2)  # the prepared model did move
