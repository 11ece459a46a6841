"""The logit losses (compress.distill.logit_losses): Hinton KD, DKD, DIST and standardized KD against values
computed by hand, finite with bounded gradients at their edges."""

import math

import pytest
import torch

from compress.distill.logit_losses import hinton as kd_loss


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


def softmax(values, t=1.0):
    e = [math.exp(v / t) for v in values]
    return [x / sum(e) for x in e]


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def test_dkd_is_the_weighted_sum_of_the_binary_and_the_non_target_divergences():
    from compress.distill.logit_losses import dkd

    s, t, target, temp = [2.0, 0.5, -1.0], [1.0, 2.0, 0.0], 1, 2.0
    ps, pt = softmax(s, temp), softmax(t, temp)
    tckd = kl([pt[1], 1 - pt[1]], [ps[1], 1 - ps[1]])
    nckd = kl(softmax([t[0], t[2]], temp), softmax([s[0], s[2]], temp))
    expected = (1.5 * tckd + 8.0 * nckd) * temp ** 2
    got = dkd(torch.tensor([s]), torch.tensor([t]), torch.tensor([target]), temp, alpha=1.5, beta=8.0)
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_dkd_of_a_confident_model_is_finite():
    from compress.distill.logit_losses import dkd

    s = torch.tensor([[200.0, -200.0, 0.0]])
    assert torch.isfinite(dkd(s, s.flip(1), torch.tensor([0]), 1.0)).item()


def pearson(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    return cov / (math.sqrt(sum((x - ma) ** 2 for x in a)) * math.sqrt(sum((y - mb) ** 2 for y in b)))


def test_dist_relates_classes_within_each_sample_and_samples_within_each_class():
    from compress.distill.logit_losses import dist

    s = [[1.0, 0.0, -1.0], [0.0, 2.0, 0.5], [0.3, 0.1, 1.0]]
    t = [[2.0, 0.5, 0.0], [0.5, 1.0, 1.5], [-1.0, 0.2, 0.8]]
    temp = 2.0
    ps, pt = [softmax(r, temp) for r in s], [softmax(r, temp) for r in t]
    inter = 1 - sum(pearson(a, b) for a, b in zip(ps, pt)) / 3
    intra = 1 - sum(pearson([r[c] for r in ps], [r[c] for r in pt]) for c in range(3)) / 3
    expected = temp ** 2 * (0.7 * inter + 1.3 * intra)
    assert dist(torch.tensor(s), torch.tensor(t), temp, beta=0.7, gamma=1.3).item() == pytest.approx(expected, rel=1e-5)
    assert dist(torch.tensor(t), torch.tensor(t), temp).item() == pytest.approx(0.0, abs=1e-4)  # float32 rounding


def test_standardized_kd_ignores_each_samples_logit_scale_and_shift():
    from compress.distill.logit_losses import standardized

    s = torch.tensor([[1.0, 2.0, 3.0]])
    assert standardized(s, 5 * s + 7, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    # z([1, 2, 3]) = [-1, 0, 1] (unbiased std 1); z([0, 0, 3]) = [-1/sqrt(3), -1/sqrt(3), 2/sqrt(3)]
    r = 1 / math.sqrt(3)
    expected = kl(softmax([-r, -r, 2 * r], 2.0), softmax([-1, 0, 1], 2.0)) * 4
    assert standardized(s, torch.tensor([[0.0, 0.0, 3.0]]), 2.0).item() == pytest.approx(expected, rel=1e-5)


def degenerate_cases(batch=8, classes=10):
    """(name, student logits, teacher logits) at the edges: a student whose logits are all equal (a fresh or
    collapsed head), nearly equal, both equal, a one-hot-ish teacher, logits of 1e4 and 1e6."""
    g = torch.Generator().manual_seed(0)
    rand = lambda scale: torch.randn(batch, classes, generator=g) * scale  # noqa: E731
    one_hot = torch.nn.functional.one_hot(torch.arange(batch) % classes, classes).float() * 1e4
    return [("equal student", torch.zeros(batch, classes), rand(3)),
            ("nearly equal student", rand(1e-6), rand(3)),
            ("equal both", torch.zeros(batch, classes), torch.zeros(batch, classes)),
            ("one-hot-ish teacher", rand(1), one_hot),
            ("huge logits", rand(1e4), rand(1e4)),
            ("huge equal student", torch.full((batch, classes), 1e6), rand(1))]


@pytest.mark.parametrize("shape", [(8, 10), (64, 100), (2, 2)])
def test_every_logit_loss_gives_finite_loss_and_bounded_gradients_at_its_edges(shape):
    """Even for a student whose logits are all equal (where std and Pearson denominators vanish), every loss, at its
    paper weight and temperature, keeps the loss finite and every gradient finite and under 2e5 (standardized KD's
    worst, a batch of 2 samples of 2
    classes: weight 9 x T^2 4 / 2 samples / its std floor 1e-4; train.clip_grad_norm bounds the step further)."""
    from compress.distill.logit_losses import LOGIT_LOSSES
    from compress.run.config import KDConfig

    for method, loss in LOGIT_LOSSES.items():
        kd = KDConfig(method=method)
        for name, student, teacher in degenerate_cases(*shape):
            student = student.clone().requires_grad_(True)
            target = torch.arange(shape[0]) % shape[1]
            value = kd.resolved_weight * loss.fn(student, teacher, target, kd.resolved_temperature, kd.params)
            value.backward()
            assert torch.isfinite(value), (method, name)
            assert torch.isfinite(student.grad).all(), (method, name)
            assert student.grad.abs().max() < 2e5, (method, name, float(student.grad.abs().max()))


def test_the_floors_leave_ordinary_logits_exactly_the_papers():
    """The floors bound only the degenerate edge: a sample whose logits spread (std above 1e-4) is standardized as
    the paper does, and DIST's correlations of spread-out probabilities are the paper's."""
    from compress.distill.logit_losses import dist, standardize

    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(16, 10, generator=g) * 2, torch.randn(16, 10, generator=g) * 2
    paper = (s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-7)
    assert torch.allclose(standardize(s), paper, rtol=1e-5, atol=1e-6)

    def paper_pearson(a, b):
        a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
        return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1) + 1e-8)

    p_s, p_t = torch.softmax(s / 4, 1), torch.softmax(t / 4, 1)
    expected = 16 * ((1 - paper_pearson(p_s, p_t).mean()) + (1 - paper_pearson(p_s.t(), p_t.t()).mean()))
    assert dist(s, t, 4.0).item() == pytest.approx(expected.item(), rel=1e-5)
