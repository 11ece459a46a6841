"""The training loop alone, on a tiny model: the schedule, fit / train_one_epoch with their Session, exact
resume from a mid-epoch checkpoint, and the distill stage's weighted loss total."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compress.data.imageset import Batch, ImageSet, TensorImages
from compress.data.sampling import train_loader
from compress.distill.logit_losses import dkd, hinton
from compress.run.config import load_config
from compress.training.loop import ResumePoint, Session, fit, train_one_epoch
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


def tiny_data(n=96, seed=0):
    """A separable 2-class problem as an in-memory image set (class = which half of the image is bright)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randint(0, 60, (n, 1, 4, 4), generator=g, dtype=torch.uint8)
    x[y == 1, :, :2] += 150
    x[y == 0, :, 2:] += 150
    data = ImageSet(y, (1, 4, 4), TensorImages(x))
    data.normalise_with((0.3,), (0.3,))
    return data


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))


def ce(model):
    return lambda batch, step: (F.cross_entropy(model(batch.x), batch.y), {"ce": 0.0})


def evaluate_on(model, data):
    def evaluate_fn(epoch):
        model.eval()
        with torch.no_grad():
            b = data.batch(range(len(data)))
            return {"val_acc": 100.0 * (model(b.x).argmax(1) == b.y).float().mean().item()}
    return evaluate_fn


def test_fit_trains_a_tiny_model_and_checkpoints_at_every_epoch_end():
    data = tiny_data()
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = train_loader(data, 16, 0, 1, seed=0)
    saved = []
    session = Session(name="tiny", seed_key=(0, "tiny"), save=lambda e, s, h, sums: saved.append((e, s, len(h))))
    history = fit(model, ce(model), optimizer, loader, Schedule("constant", 0.5, 4, len(loader)),
                  evaluate_on(model, data), session)
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert history[-1]["train_loss"] < history[0]["train_loss"] and history[-1]["val_acc"] >= 95.0
    assert saved == [(1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 0, 4)]  # (epoch, step, finished epochs) at each end
    assert "train_ce" in history[0]  # every loss term is averaged per epoch


def test_train_one_epoch_runs_on_any_iterable_of_batches():
    """Nothing but an iterable of Batches is needed: the loop is testable without a run directory or sampler."""
    model = tiny_model()
    b = tiny_data().batch(range(16))
    sums = train_one_epoch(model, ce(model), torch.optim.SGD(model.parameters(), lr=0.1), [b, b],
                           Schedule("constant", 0.1, 1, 2), 0, Session())
    assert sums["images"] == 32 and sums["loss"] > 0


def test_auto_precision_on_a_cpu_trains_in_bf16_only_where_it_pays():
    """bf16 where the CPU computes it natively, except for convolutional models built on depthwise convolutions
    (one filter group per input channel), which train slower in it; a model with depthwise convolutions whose
    linear layers do most of the work (ConvNeXt) keeps bf16; grouped convolutions are not depthwise; an explicit
    choice is kept."""
    from compress.models.registry import build_model
    from compress.training.precision import Precision, cpu_auto, linear_share

    x = torch.randn(1, 3, 32, 32)
    dense = build_model("compact_cnn", (3, 32, 32), 10)
    mobile = build_model("torchvision:mobilenet_v3_small", (3, 32, 32), 10)
    grouped = nn.Sequential(nn.Conv2d(3, 32, 3, groups=1), nn.Conv2d(32, 32, 1, groups=4))
    depthwise = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 32, 3, groups=16), nn.Flatten(),
                              nn.Linear(28 * 28 * 32, 2))
    mlp_heavy = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 7, padding=3, groups=16),
                              nn.Flatten(), nn.Linear(16 * 32 * 32, 512), nn.Linear(512, 2))
    # multiply-adds by hand: 16x32x32 outputs x 27 + 16x32x32 x 49, then 16,384 x 512 + 512 x 2
    assert linear_share([mlp_heavy], x) == (16384 * 512 + 1024) / (16384 * (27 + 49) + 16384 * 512 + 1024)
    assert cpu_auto("amx_bf16", [dense], x) == ("bf16", "auto: this CPU computes bf16 natively (amx_bf16)")
    assert cpu_auto("avx512_bf16", [dense, grouped], x)[0] == "bf16"
    assert cpu_auto("amx_bf16", [dense, mobile], x) == (
        "fp32", "auto: this CPU computes bf16 natively (amx_bf16), but bf16 trains convolutional models built on "
                "depthwise convolutions (11 here) slower than fp32 on a CPU, so fp32")
    assert cpu_auto("amx_bf16", [depthwise], x)[1].endswith("(1 here) slower than fp32 on a CPU, so fp32")
    assert cpu_auto("amx_bf16", [mlp_heavy], x) == ("bf16", "auto: this CPU computes bf16 natively (amx_bf16)")
    assert cpu_auto(None, [dense], x) == ("fp32", "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16), "
                                                  "so fp32")
    assert mobile.training and dense.training  # counting ran them in eval mode and put them back
    forced = Precision.for_run("bf16", torch.device("cpu"), [mobile], x)
    assert forced.name == "bf16" and forced.reason == "train.precision=bf16"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resuming_from_a_mid_epoch_point_gives_the_uninterrupted_weights(precision):
    """Data order from (seed, epoch), learning rate from the step, RNG (dropout) reseeded every step: a run
    continued from the state saved after step 3 of epoch 2 ends bit-identical to the run that never stopped -
    in fp32 and under bf16 autocast (forced here, so it is checked on every CPU, native bf16 or not)."""
    import copy

    from compress.training.precision import Precision

    data = tiny_data()
    captured = {}

    def train(model, optimizer, resume, save=None):
        loader = train_loader(data, 16, 0, 1, seed=3)
        schedule = Schedule("cosine", 0.3, 3, len(loader), warmup_epochs=0.5)
        session = Session(name="tiny", seed_key=(3, "tiny"), resume=resume, save=save, save_every=3,
                          precision=Precision.for_run(precision, torch.device("cpu")))
        fit(model, ce(model), optimizer, loader, schedule, lambda e: {"val_acc": 0.0}, session)
        return model

    def capture(model, optimizer):
        def save(epoch, step, history, sums):
            if (epoch, step) == (1, 3):
                captured.update(model=copy.deepcopy(model.state_dict()), optimizer=copy.deepcopy(
                    optimizer.state_dict()), point=ResumePoint(1, 3, list(history), dict(sums)))
        return save

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    straight = train(model, optimizer, ResumePoint(), capture(model, optimizer))
    assert captured, "no checkpoint at epoch 2, step 3"
    resumed_model = tiny_model(seed=99)  # other initial weights: everything must come from the checkpoint
    resumed_model.load_state_dict(captured["model"])
    resumed_optimizer = torch.optim.SGD(resumed_model.parameters(), lr=0.3, momentum=0.9)
    resumed_optimizer.load_state_dict(captured["optimizer"])
    resumed = train(resumed_model, resumed_optimizer, captured["point"])
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert a.dtype == torch.float32  # autocast computes in bf16; the weights stay fp32
        assert torch.equal(a, b)
    assert not torch.equal(straight[1].weight, tiny_model()[1].weight), "nothing was trained"


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


def test_unlabelled_and_mixed_images_in_the_label_loss():
    from compress.training.losses import label_loss

    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y, partner = torch.tensor([0, -1, 1]), torch.tensor([0, -1, 0])
    batch = Batch(None, y, None, None, partner, torch.tensor([1.0, 1.0, 0.25]))
    each = [F.cross_entropy(logits[i:i + 1], torch.tensor([c])).item() for i, c in ((0, 0), (2, 1), (2, 0))]
    # sample 0: its own label, weight 1; sample 1: unlabelled, weight 0; sample 2: 1/4 own label, 3/4 partner's
    expected = (each[0] + 0.25 * each[1] + 0.75 * each[2]) / 2.0
    assert label_loss(logits, batch).item() == pytest.approx(expected, rel=1e-6)


def test_an_epoch_resumed_after_its_last_step_reports_no_speed_but_keeps_its_loss():
    """Interrupted after the last step of an epoch, the rerun trains no image of it: its speed is not a figure
    (it was millions of images/s: every image over no time), while its loss still averages the whole epoch."""
    data = tiny_data()
    model = tiny_model()
    loader = train_loader(data, 16, 0, 1, seed=0)
    steps = len(loader)
    running = {"images": 96.0, "loss": 96 * 0.5, "ce": 0.0}
    session = Session(name="tiny", seed_key=(0, "tiny"), resume=ResumePoint(0, steps, [], running))
    history = fit(model, ce(model), torch.optim.SGD(model.parameters(), lr=0.1), loader,
                  Schedule("constant", 0.1, 2, steps), evaluate_on(model, data), session)
    assert history[0]["images_per_s"] is None
    assert history[0]["train_loss"] == pytest.approx(0.5)
    assert history[1]["images_per_s"] > 0  # the next epoch trains every image again
    # mid-epoch: the images trained before the resume point are carried into the loss, not into the speed
    from compress.training.loop import _carried_images

    point = ResumePoint(1, 3, [], {"images": 48.0, "loss": 10.0})
    assert _carried_images(Session(resume=point), 1) == 48.0
    assert _carried_images(Session(resume=point), 2) == 0.0  # a later epoch starts from nothing
    assert _carried_images(Session(resume=ResumePoint(1, 0, [], None)), 1) == 0.0


def one_step(model, loss_fn, clip=None, lr=1.0):
    """One plain-SGD step of `loss_fn` through the loop; returns how far the weights moved (L2)."""
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    b = tiny_data().batch(range(16))
    train_one_epoch(model, loss_fn, torch.optim.SGD(model.parameters(), lr=lr), [b],
                    Schedule("constant", lr, 1, 1), 0, Session(clip_grad_norm=clip))
    return float((torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm())


def test_train_clip_grad_norm_bounds_every_update_and_is_off_by_default():
    """train.clip_grad_norm: a step's gradients (here 1e6 times cross-entropy's) are scaled down to the norm, so an
    SGD step of lr 1 moves the weights by at most that; unset, the step is the full one."""
    model = tiny_model()
    huge = lambda batch, step: (1e6 * F.cross_entropy(model(batch.x), batch.y), {})  # noqa: E731
    assert one_step(model, huge, clip=0.5) == pytest.approx(0.5, rel=1e-4)
    model = tiny_model()
    huge = lambda batch, step: (1e6 * F.cross_entropy(model(batch.x), batch.y), {})  # noqa: E731
    assert one_step(model, huge) > 1e3
    assert load_config(None).train.clip_grad_norm is None
    assert load_config(None, ["train.clip_grad_norm=2.5"]).train.clip_grad_norm == 2.5


def test_train_clip_grad_norm_never_reruns_a_finished_stage(finished_run, tmp_path):
    """It is in `train` (how to run): a finished run is up to date under any value of it."""
    import shutil

    from conftest import invoke

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    result = invoke("run", "--run-dir", run, "--dry-run", "--set", "train.clip_grad_norm=1.0")
    assert result.exit_code == 0, result.output
    assert [line.split()[1] for line in result.output.splitlines() if line.split()[:1] and line.split()[0] in (
        "teacher", "distill", "qat", "export")] == ["skip"] * 4


def test_a_nan_from_degenerate_inputs_names_the_normalisation_not_the_learning_rate():
    """Was: images normalised by a std of almost nothing (data.std tiny, or computed on images without spread)
    gave a NaN loss and the advice 'lower teacher.lr', which no learning rate mends."""
    from compress.errors import StageFailed

    model = tiny_model()
    b = tiny_data().batch(range(16))
    b = b._replace(x=b.x * 1e30)  # what a std of 1e-30 makes of the pixels
    loss_fn = lambda batch, step: (F.cross_entropy(model(batch.x) * float("inf"), batch.y), {})  # noqa: E731
    with pytest.raises(StageFailed, match=r"teacher: the loss became nan at epoch 1, step 1; the last resume "
                                          r"checkpoint is kept - the images the model saw were already non-finite "
                                          r"or huge after normalisation: data.std is near 0") as info:
        train_one_epoch(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), [b],
                        Schedule("constant", 0.1, 1, 1), 0, Session(name="teacher"))
    assert "lower teacher.lr" not in str(info.value)
    model = tiny_model()  # ordinary images: the advice stays the learning rate's
    b = tiny_data().batch(range(16))
    with pytest.raises(StageFailed, match="lower teacher.lr"):
        train_one_epoch(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), [b],
                        Schedule("constant", 0.1, 1, 1), 0, Session(name="teacher"))


class Terminal:
    """A stream that says it is a terminal and keeps what the bar draws."""

    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_a_resumed_epochs_progress_bar_counts_from_where_it_resumed():
    """Was: resuming at step 8 of 74 drew '1/67' (this run's steps alone); now '8/74', as the log counts."""
    from compress.training.progress import Progress

    screen = Terminal()
    bar = Progress(74, "teacher 2/5", stream=screen, done=7)
    bar.update(loss=0.5)
    assert " 8/74 " in screen.text and "1/67" not in screen.text
    model, stream = tiny_model(), Terminal()
    b = tiny_data().batch(range(16))
    import sys

    saved, sys.stderr = sys.stderr, stream  # the loop draws on stderr
    try:
        train_one_epoch(model, ce(model), torch.optim.SGD(model.parameters(), lr=0.1), [b, b],
                        Schedule("constant", 0.1, 1, 5), 0, Session(progress=True, resume=ResumePoint(0, 3)))
    finally:
        sys.stderr = saved
    assert " 4/5 " in stream.text and " 5/5 " in stream.text and " 1/2 " not in stream.text


def test_clipping_under_two_processes_keeps_the_replicas_identical(tiny_config, tmp_path):
    """The gradients are averaged over the ranks before they are clipped, so every rank scales them alike and the
    replicas stay one model (2 real gloo processes; a tight clip so it acts on every step)."""
    import json

    from conftest import compress_subprocess

    run = tmp_path / "run"
    proc = compress_subprocess("run", "-c", tiny_config, "--run-dir", run, "--stages", "teacher", "--nproc-per-node",
                               "2", "--set", "train.clip_grad_norm=0.05", "--set", "teacher.epochs=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "manifest.json").read_text())["stages"]["teacher"]["metrics"]
    assert metrics["replicas_identical"] is True
