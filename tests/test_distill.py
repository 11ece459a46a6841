import pytest
import torch

from compress.config import load_config
from compress.data import load_data
from compress.dist import DistEnv
from compress.distillation import FrozenTeacher, build_cache
from compress.errors import InputError
from compress.features import FeatureTap
from compress.models import build_model
from stages.distill import build_student, make_loss


def test_hooks_read_named_layers_of_an_unmodified_torchvision_model():
    model = build_model("resnet18", (3, 32, 32), 10).eval()
    tap = FeatureTap(model, ["layer3", "avgpool"])
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    assert tap.outputs["layer3"].shape == (2, 256, 8, 8) and tap.outputs["avgpool"].shape == (2, 512, 1, 1)
    tap.remove()
    assert not model.layer3._forward_hooks


def test_wrong_layer_name_lists_the_available_layers():
    with pytest.raises(InputError, match=r"the teacher has no layer 'layer9'; available layers: conv1, bn1"):
        FeatureTap(build_model("resnet18", (3, 32, 32), 10), ["layer9"], role="teacher")


def setup(*overrides):
    cfg = load_config(None, ["data.name=digits", "distill.cosine.weight=0.3", "distill.hint.weight=0.2",
                             "distill.hint.student_layer=block1", *overrides])
    data = load_data(cfg.data, cfg.seed)
    torch.manual_seed(1)
    d = cfg.distill
    teacher = FrozenTeacher(build_model(cfg.model.teacher, data.input_shape, 10), d.cosine.teacher_layer,
                            d.hint.teacher_layer)
    student = build_student(cfg, data, teacher)
    return cfg, data, teacher, student


def test_cached_and_per_batch_teacher_give_the_same_loss():
    cfg, data, teacher, student = setup()
    cache = build_cache(teacher, data.train, DistEnv(), batch_size=100)
    idx = list(range(0, 64, 2))
    batch = data.train.batch(idx)
    student.train()
    cached_loss, cached_parts = make_loss(cfg, student, teacher, cache, "cpu")(batch)
    live_loss, live_parts = make_loss(cfg, student, teacher, None, "cpu")(batch)
    assert set(cached_parts) == {"ce", "kd", "cosine", "hint"}
    assert cached_loss.item() == pytest.approx(live_loss.item(), rel=1e-5)
    for k in cached_parts:
        assert cached_parts[k] == pytest.approx(live_parts[k], rel=1e-5, abs=1e-6)


def test_cached_views_give_the_teacher_outputs_of_the_very_batch_the_student_sees():
    """Consistent teaching with a view cache: for any epoch, the cached outputs looked up by (sample, view)
    are the teacher's outputs on exactly the augmented images of the batch."""
    cfg, data, teacher, student = setup("data.augment=pad_crop", "distill.views=3")
    data.train.augment.views = 3
    cache = build_cache(teacher, data.train, DistEnv(), batch_size=64, views=3)
    assert cache.tensors["logits"].shape == (3 * len(data.train), 10)
    for epoch in (0, 5):
        batch = data.train.batch(range(40, 72), epoch=epoch)
        assert set(batch.view.tolist()) <= {0, 1, 2} and len(set(batch.view.tolist())) > 1
        cached = cache.lookup(batch.index, batch.view, "cpu")
        live = teacher(batch.x)
        for key in live:
            assert torch.allclose(cached[key], live[key], atol=1e-5), key


def test_hint_regressor_trains_with_the_student():
    cfg, data, teacher, student = setup()
    assert student.regressor is not None
    loss, _ = make_loss(cfg, student, teacher, None, "cpu")(data.train.batch(range(32)))
    loss.backward()
    assert student.regressor.weight.grad is not None and student.regressor.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.model.parameters()), "the teacher must stay frozen"


def test_shapes_that_cannot_be_reconciled_fail_before_training():
    with pytest.raises(InputError, match="differ in spatial size"):
        setup("distill.hint.student_layer=stem")
    with pytest.raises(InputError, match="cannot reduce a teacher representation"):
        setup("distill.cosine.teacher_layer=pool", "distill.cosine.student_layer=block1")
