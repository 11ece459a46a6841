"""The model registry (compress.models.registry): every model described, adapted to its input and traceable
by torch.fx."""

import pytest
import torch
from torch.fx import symbolic_trace

from compress.models.registry import DESCRIPTIONS, MODELS, build_model


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
