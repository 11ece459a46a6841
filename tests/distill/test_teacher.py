"""The frozen teacher and the student with its regressor (compress.distill.teacher): the regressor trains with
the student, shapes that cannot be reconciled fail before training, the teacher cannot be changed from
outside."""

import pytest
import torch

from compress.data.datasets import load_data
from compress.distill.objective import make_loss
from compress.distill.teacher import FrozenTeacher
from compress.errors import InputError
from compress.models.registry import build_model
from compress.run.config import load_config
from stages.distill import build_pair


def setup(*overrides, hint=True):
    cfg = load_config(None, ["data.name=digits", "distill.cosine.weight=0.3", "distill.kd.weight=0.5",
                             *(["distill.hint.weight=0.2", "distill.hint.student_layer=block1"] if hint else []),
                             *overrides])
    data = load_data(cfg.data, cfg.seed)
    torch.manual_seed(1)
    student, teacher = build_pair(cfg, data, build_model(cfg.model.teacher, data.input_shape, 10))
    return cfg, data, teacher, student


def test_hint_regressor_trains_with_the_student():
    cfg, data, teacher, student = setup()
    assert student.adapters["regressor"] is not None
    loss, _ = make_loss(cfg.distill, student, teacher, None, 10)(data.train.batch(range(32)), 0)
    loss.backward()
    regressor = student.adapters["regressor"]
    assert regressor.weight.grad is not None and regressor.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.model.parameters()), "the teacher must stay frozen"


def test_shapes_that_cannot_be_reconciled_fail_before_training():
    with pytest.raises(InputError, match="differ in spatial size"):
        setup("distill.hint.student_layer=stem")
    with pytest.raises(InputError, match="cannot reduce a teacher representation"):
        setup("distill.cosine.teacher_layer=pool", "distill.cosine.student_layer=block1")


def test_frozen_teacher_is_not_changed_from_outside():
    """The stored feature width is fixed when the teacher is wrapped, from the probed student shape."""
    cfg, data, teacher, student = setup(hint=False)
    assert isinstance(teacher, FrozenTeacher) and teacher.stored_width == 64
    assert teacher(data.val.batch([0, 1]).x)["cosine"].shape == (2, 64)
