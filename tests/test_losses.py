import math

import pytest
import torch

from compress.distill.feature_losses import cosine_loss, hint_loss, make_regressor, reduce_width
from compress.distill.logit_losses import hinton as kd_loss
from compress.errors import InputError


def test_kd_loss_matches_a_hand_computed_value():
    s = torch.tensor([[1.0, 0.0]])
    t = torch.tensor([[0.0, 1.0]])
    temp = 2.0
    # softmax([0.5, 0]) and softmax([0, 0.5]); KL(p_t || p_s) * T^2
    ps = [math.exp(0.5) / (math.exp(0.5) + 1), 1 / (math.exp(0.5) + 1)]
    pt = ps[::-1]
    expected = sum(p * math.log(p / q) for p, q in zip(pt, ps)) * temp ** 2
    assert kd_loss(s, t, temp).item() == pytest.approx(expected, rel=1e-6)
    assert kd_loss(t, t, temp).item() == pytest.approx(0.0, abs=1e-7)


def test_kd_loss_is_a_batch_mean():
    s, t = torch.randn(1, 5), torch.randn(1, 5)
    assert kd_loss(s.repeat(4, 1), t.repeat(4, 1), 3.0).item() == pytest.approx(kd_loss(s, t, 3.0).item(), rel=1e-6)


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
