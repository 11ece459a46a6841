"""Learning-rate schedules (compress.training.schedule): warm-up then cosine, step and constant, and an
unknown kind refused."""

import math

import pytest

from compress.training.schedule import Schedule


def test_schedule_warms_up_linearly_then_follows_cosine_to_zero():
    s = Schedule("cosine", lr=0.4, epochs=10, steps_per_epoch=10, warmup_epochs=2)
    assert s.lr_at(0) == pytest.approx(0.4 / 20) and s.lr_at(19) == pytest.approx(0.4)
    assert s.lr_at(20) == pytest.approx(0.4)  # the first step after warm-up: the top of the cosine
    assert s.lr_at(60) == pytest.approx(0.2)  # halfway through the 80 cosine steps
    assert s.lr_at(99) == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 79 / 80)))
    assert s.lr_at(99) < 0.001


def test_step_and_constant_schedules():
    s = Schedule("step", lr=1.0, epochs=9, steps_per_epoch=5, step_size=3, gamma=0.5)
    assert [s.lr_at(e * 5) for e in range(9)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25]
    assert Schedule("constant", lr=0.3, epochs=2, steps_per_epoch=4).lr_at(7) == 0.3


def test_an_unknown_schedule_kind_is_refused_not_treated_as_constant():
    with pytest.raises(ValueError, match="unknown schedule 'flat'"):
        Schedule("flat", 0.1, 1, 1)
