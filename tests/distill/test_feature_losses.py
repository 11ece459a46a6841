"""The feature losses (compress.distill.feature_losses): cosine and the FitNets hint against values computed by
hand, the width reduction and the regressors."""

import pytest
import torch

from compress.distill.feature_losses import cosine_loss, hint_loss, make_regressor, reduce_width
from compress.errors import InputError


def test_cosine_loss_hand_values():
    s = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    t = torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    # 1 - cos: orthogonal -> 1, parallel -> 0; mean 0.5
    assert cosine_loss(s, t).item() == pytest.approx(0.5, abs=1e-6)


def test_reduce_width_averages_neighbours_like_the_tutorial():
    t = torch.arange(8.0).view(1, 2, 2, 2)  # flattens to 0..7
    assert reduce_width(t, 4).tolist() == [[0.5, 2.5, 4.5, 6.5]]
    assert torch.equal(reduce_width(t, 8), t.flatten(1))
    with pytest.raises(InputError, match="cannot reduce a teacher representation of width 8"):
        reduce_width(t, 16)


def test_hint_loss_is_mse():
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 2.0]])
    assert hint_loss(a, b).item() == pytest.approx(2.0)


def test_regressors_map_student_to_teacher_shape():
    reg = make_regressor("conv3x3", (16, 8, 8), (32, 8, 8))
    assert reg(torch.randn(2, 16, 8, 8)).shape == (2, 32, 8, 8)
    assert make_regressor("conv1x1", (16, 4, 4), (8, 4, 4))(torch.randn(1, 16, 4, 4)).shape == (1, 8, 4, 4)
    assert make_regressor("linear", (64,), (32, 2, 2))(torch.randn(3, 64)).shape == (3, 128)
    with pytest.raises(InputError, match="differ in spatial size"):
        make_regressor("conv3x3", (16, 8, 8), (32, 4, 4))
    with pytest.raises(InputError, match="needs 4-D feature maps"):
        make_regressor("conv1x1", (64,), (32, 4, 4))
