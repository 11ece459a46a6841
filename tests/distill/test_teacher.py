import pytest
import torch

from compress.data.datasets import load_data
from compress.distill.objective import make_loss
from compress.distill.report import epoch_passing
from compress.distill.store import StoreSpec, TeacherOutputStore, default_top_k
from compress.distill.teacher import FrozenTeacher
from compress.errors import InputError
from compress.models.features import FeatureTap
from compress.models.registry import build_model
from compress.run.config import load_config
from compress.training.distributed import DistEnv
from stages.distill import build_pair, report_notes


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


def test_a_long_layer_list_shows_the_top_level_first_and_a_near_name_is_suggested():
    """Was (second fresh-user pass): torchvision resnet18's 62 layers cut at 40 hid `avgpool`, the layer a user
    wants after the default `pool` is refused."""
    from compress.distill.teacher import layer_problems
    from compress.models.features import layer_list

    model = build_model("torchvision:resnet18", (3, 32, 32), 10)
    assert layer_list(model).startswith("conv1, bn1, relu, maxpool, layer1, layer2, layer3, layer4, avgpool, fc at "
                                        "the top level; all: conv1, bn1,")
    d = load_config(None, ["distill.cosine.weight=1"]).distill  # cosine.teacher_layer: pool
    assert "the teacher has no layer 'pool'; did you mean 'maxpool' or 'avgpool'?" in layer_problems(d, None, model)[0]


def setup(*overrides, hint=True):
    cfg = load_config(None, ["data.name=digits", "distill.cosine.weight=0.3", "distill.kd.weight=0.5",
                             *(["distill.hint.weight=0.2", "distill.hint.student_layer=block1"] if hint else []),
                             *overrides])
    data = load_data(cfg.data, cfg.seed)
    torch.manual_seed(1)
    student, teacher = build_pair(cfg, data, build_model(cfg.model.teacher, data.input_shape, 10))
    return cfg, data, teacher, student


def store_for(tmp_path, cfg, data, teacher, train_set, top_k=None):
    a = train_set.augment
    spec = StoreSpec("0" * 64, cfg.model.teacher, train_set.fingerprint(), len(train_set), a.views, 10,
                     default_top_k(10, top_k), {"kind": a.kind, "flip": a.flip, "view_seed": a.view_seed}, "fp32",
                     teacher.cosine_layer or "", teacher.cosine_width or 0, rows_per_chunk=100)
    store = TeacherOutputStore(str(tmp_path / "store"), spec)
    plan = store.prepare(DistEnv())
    store.build(teacher, train_set, DistEnv(), 64, lambda x: x, plan)
    return store.open(), plan


def test_stored_and_live_teacher_give_the_same_loss(tmp_path):
    cfg, data, teacher, student = setup(hint=False)
    train_set = data.train.with_augment(views=1)
    store, plan = store_for(tmp_path, cfg, data, teacher, train_set)
    assert plan["status"] == "build" and store.spec.chunks == -(-len(train_set) // 100)
    batch = train_set.batch(range(0, 64, 2), epoch=0)
    student.train()
    stored_loss, stored_parts = make_loss(cfg.distill, student, teacher, store, 10)(batch, 0)
    live_loss, live_parts = make_loss(cfg.distill, student, teacher, None, 10)(batch, 0)
    assert set(stored_parts) == {"ce", "kd", "cosine"}
    # the store keeps fp16: the same loss to fp16's resolution
    assert stored_loss.item() == pytest.approx(live_loss.item(), rel=1e-3)
    for k in stored_parts:
        assert stored_parts[k] == pytest.approx(live_parts[k], rel=1e-3, abs=1e-4)


def test_stored_views_are_the_teacher_outputs_of_the_very_pixels_the_student_sees(tmp_path):
    """Consistent teaching: for any epoch, the stored outputs looked up by (sample, view) are the teacher's
    outputs on exactly the augmented (and mixed) images of the batch."""
    cfg, data, teacher, student = setup("data.augment=pad_crop", hint=False)
    train_set = data.train.with_augment(views=3, view_seed=5, mix="cutmix")
    store, _ = store_for(tmp_path, cfg, data, teacher, train_set)
    for epoch in (0, 1, 5):
        batch = train_set.batch(range(40, 72), epoch=epoch)
        assert set(batch.view.tolist()) == {epoch % 3}
        stored = store.lookup(batch.index, batch.view, "cpu")
        live = teacher(batch.x)
        for key in ("logits", "cosine"):
            assert torch.allclose(stored[key], live[key].float(), atol=2e-2, rtol=1e-2), key


def test_hint_regressor_trains_with_the_student():
    cfg, data, teacher, student = setup()
    assert student.regressor is not None
    loss, _ = make_loss(cfg.distill, student, teacher, None, 10)(data.train.batch(range(32)), 0)
    loss.backward()
    assert student.regressor.weight.grad is not None and student.regressor.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.model.parameters()), "the teacher must stay frozen"


def test_shapes_that_cannot_be_reconciled_fail_before_training():
    with pytest.raises(InputError, match="differ in spatial size"):
        setup("distill.hint.student_layer=stem")
    with pytest.raises(InputError, match="cannot reduce a teacher representation"):
        setup("distill.cosine.teacher_layer=pool", "distill.cosine.student_layer=block1")


def test_frozen_teacher_is_not_changed_from_outside():
    """The cosine width is fixed when the teacher is wrapped (it used to be patched in afterwards)."""
    cfg, data, teacher, student = setup(hint=False)
    assert isinstance(teacher, FrozenTeacher) and teacher.cosine_width == 64
    assert teacher(data.val.batch([0, 1]).x)["cosine"].shape == (2, 64)


def test_the_report_says_when_the_distilled_student_reached_the_student_alone():
    history = [{"epoch": 1, "val_acc": 50.0}, {"epoch": 2, "val_acc": 71.0}, {"epoch": 3, "val_acc": 69.0},
               {"epoch": 4, "val_acc": 74.0}, {"epoch": 5, "val_acc": 74.5}]
    assert epoch_passing(history, 70.0) == 4  # not 2: epoch 3 fell back below
    assert epoch_passing(history, 68.0) == 2 and epoch_passing(history, 74.5) == 5
    assert epoch_passing(history, 75.0) is None
    m = {"kd_method": "standardized", "val_acc": 74.0, "baseline_val_acc": 70.0, "teacher_val_acc": 80.0,
         "gain_points": 4.0, "epochs": 4, "epoch_passing_alone": 2}
    assert ("From epoch 2 of 4 on (50% of the way through the same learning-rate schedule) it stayed at or above "
            "the student alone's final accuracy.") in report_notes({"metrics": m})[0]
    assert "only at its last epoch" in report_notes({"metrics": {**m, "epoch_passing_alone": 4}})[0]
    for quiet in ({"gain_points": -1.0}, {"epoch_passing_alone": None}, {"epoch_passing_alone": 0}):
        assert "reached the student alone" not in report_notes({"metrics": {**m, **quiet}})[0]
    old = {k: v for k, v in m.items() if k != "epoch_passing_alone"}  # a run from before this was measured
    assert "reached the student alone" not in report_notes({"metrics": old})[0]
