"""The distill loss (compress.distill.objective.make_loss): the weighted sum of its terms, and DKD's warm-up."""

import pytest
import torch
import torch.nn.functional as F

from compress.distill.logit_losses import dkd, hinton
from compress.run.config import load_config


def distill_setup(*overrides):
    from compress.data.datasets import load_data
    from compress.models.registry import build_model
    from stages.distill import build_pair

    cfg = load_config(None, ["data.name=digits", *overrides])
    data = load_data(cfg.data, cfg.seed)
    torch.manual_seed(0)
    student, teacher = build_pair(cfg, data, build_model("resnet8", data.input_shape, 10))
    return cfg, data, student, teacher


def test_the_distill_loss_is_the_weighted_sum_of_its_terms():
    """Every weight counts, label smoothing counts: the stage's total equals the sum computed here from the
    terms' own formulas."""
    from compress.distill.objective import make_loss

    cfg, data, student, teacher = distill_setup("distill.kd.method=hinton", "distill.ce_weight=0.3",
                                                "distill.kd.weight=2.5", "distill.kd.temperature=3",
                                                "distill.label_smoothing=0.2")
    batch = data.train.batch(range(24))
    student.eval()
    total, parts = make_loss(cfg.distill, student, teacher, None, 10)(batch, 0)
    s, t = student(batch.x)[0], teacher(batch.x)["logits"]
    ce_term = F.cross_entropy(s, batch.y, label_smoothing=0.2)
    kd_term = hinton(s, t, 3.0)
    assert parts == pytest.approx({"ce": ce_term.item(), "kd": kd_term.item()}, rel=1e-5)
    assert total.item() == pytest.approx(0.3 * ce_term.item() + 2.5 * kd_term.item(), rel=1e-5)
    plain = F.cross_entropy(s, batch.y).item()
    assert parts["ce"] != pytest.approx(plain, rel=1e-6), "label smoothing must change the cross-entropy term"


def test_dkd_weight_ramps_up_over_its_warm_up_epochs():
    from compress.distill.objective import make_loss

    cfg, data, student, teacher = distill_setup("distill.kd.method=dkd", "distill.ce_weight=0",
                                                "distill.kd.weight=1", "distill.kd.dkd.warmup_epochs=4")
    batch = data.train.batch(range(24))
    student.eval()
    loss_fn = make_loss(cfg.distill, student, teacher, None, 10)  # 10 steps per epoch: warm-up over 40 steps
    s, t = student(batch.x)[0], teacher(batch.x)["logits"]
    full = dkd(s, t, batch.y, 4.0, 1.0, 8.0).item()
    assert loss_fn(batch, 0)[0].item() == pytest.approx(full / 40, rel=1e-5)
    assert loss_fn(batch, 19)[0].item() == pytest.approx(full / 2, rel=1e-5)
    assert loss_fn(batch, 100)[0].item() == pytest.approx(full, rel=1e-5)
