"""The qat stage's loss (compress.quant.objective): distilling from a frozen copy of the float student."""

import torch

from compress.models.registry import build_model
from compress.quant import fx as quant
from compress.quant.objective import frozen_copy


def test_qat_distils_from_an_untouched_frozen_copy_of_the_float_model():
    """The target of QAT's distillation term is the float model as it was before prepare_qat_fx edited it (fused
    BN, observers) and before any QAT step: a copy that shared modules with the prepared model would drift with
    it and teach nothing."""
    torch.manual_seed(0)
    model = build_model("compact_cnn", (3, 32, 32), 10)
    x = torch.randn(8, 3, 32, 32)
    reference = frozen_copy(model)
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
