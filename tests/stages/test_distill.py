"""The distill stage end to end on the tiny digits config: every logit loss through the teacher-output store,
unlabelled images, kill -9 during training and during the store's build (then bit-identical), 2-process DDP
building the same store as one process, and teachers or students hardly better than chance named."""

import json
import os
import re
import shutil
import signal

import numpy as np
import pytest
import torch
from PIL import Image

from compress.distill.report import epoch_passing
from compress.training.checkpoint import read_weights
from compress.training.precision import cpu_bf16_support
from conftest import compress_subprocess, fault_subprocess, invoke

pytestmark = pytest.mark.e2e

STUDENT = "distill/model.safetensors"


@pytest.fixture(scope="module")
def teacher_run(tiny_config, tmp_path_factory):
    """A run directory holding only the tiny config's trained teacher (three epochs on 600 digits)."""
    run = tmp_path_factory.mktemp("teacher") / "run"
    result = invoke("run", "-c", tiny_config, "--run-dir", run, "--stages", "teacher", "--set", "teacher.epochs=3",
                    "--set", "data.limit=600")
    assert result.exit_code == 0, result.output
    return run


@pytest.fixture(scope="module")
def unlabeled(tmp_path_factory):
    """40 unlabelled 8x8 grey images in nested folders (the digits' own size)."""
    root = tmp_path_factory.mktemp("unlabeled")
    rng = np.random.default_rng(0)
    for i in range(40):
        folder = root / f"batch{i % 3}"
        folder.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def copy_of(teacher_run, tmp_path, name="run"):
    target = tmp_path / name
    shutil.copytree(teacher_run, target)
    return target


def distill(run, tiny_config, *overrides, fault=None, in_process=False):
    """The distill stage on 600 of the digits, 2 epochs: in a subprocess (for a fault), or in-process."""
    args = ["run", "-c", tiny_config, "--run-dir", run, "--stages", "distill", "--set", "teacher.epochs=3",
            "--set", "data.limit=600", "--set", "distill.epochs=2", "--set", "distill.hint.weight=0",
            "--set", "distill.baseline=false", *[a for o in overrides for a in ("--set", o)]]
    if in_process:
        result = invoke(*args)
        return type("Done", (), {"returncode": result.exit_code, "stderr": result.stderr})
    return fault_subprocess(*args, fault=fault) if fault else compress_subprocess(*args)


def metrics(run):
    return json.loads((run / "manifest.json").read_text())["stages"]["distill"]["metrics"]


def same_weights(a, b):
    x, _ = read_weights(a / STUDENT)
    y, _ = read_weights(b / STUDENT)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_every_logit_loss_trains_from_one_store_built_once(teacher_run, tiny_config, tmp_path):
    run = copy_of(teacher_run, tmp_path)
    statuses = []
    for method in ("hinton", "dkd", "dist", "standardized"):
        proc = distill(run, tiny_config, f"distill.kd.method={method}", in_process=True)
        assert proc.returncode == 0, proc.stderr
        m = metrics(run)
        assert m["kd_method"] == method and m["losses"] == ["ce", "kd"] and m["val_acc"] > 20, m
        statuses.append(m["teacher_outputs"]["status"])
    assert statuses == ["build", "reuse", "reuse", "reuse"]  # another loss: the teacher runs zero times


def test_unlabelled_images_train_the_student_through_the_teacher(teacher_run, tiny_config, tmp_path, unlabeled):
    run = copy_of(teacher_run, tmp_path)
    proc = distill(run, tiny_config, f"data.unlabeled={unlabeled}", "distill.baseline=true", in_process=True)
    assert proc.returncode == 0, proc.stderr
    m = metrics(run)
    assert (m["labelled_images"], m["unlabelled_images"]) == (600, 40)
    assert m["teacher_outputs"]["samples"] == 640 and "baseline_val_acc" in m
    report = (run / "report.md").read_text()
    assert "also learned from 40 unlabelled images" in report and "saw only the 600 labelled ones" in report
    # the comparison says an epoch of 640 images is more optimizer steps than one of 600, not "same schedule"
    assert "(same initialisation, seed, augmented views and number of epochs)" in report
    assert (f"so each of its epochs was 1.1x fewer optimizer steps: part of the gain is that extra training. The "
            f"student alone trained for {-(-m['epochs'] * 640 // 600)} epochs would take as many steps") in report
    assert "of the way through the same learning-rate schedule" not in report
    # is the gain beyond noise? the two students image by image, in the precision their accuracies were taken in
    assert m["val_images"] * m["gain_points"] / 100 == pytest.approx(m["distilled_only_right"] - m["alone_only_right"],
                                                                   abs=0.01)
    without = distill(run, tiny_config, "data.unlabeled=null", "distill.baseline=true", in_process=True)
    assert "distill: the student alone is the one an earlier run trained" in without.stderr  # it never saw them
    assert (f"Of {m['val_images']:,} validation images, {m['distilled_only_right']} are right only with the distilled "
            f"student and {m['alone_only_right']} only with the student alone (McNemar p ") in report
    # the gain in training time, from the two students' per-epoch files (the rule itself: tests/distill/test_report.py)
    distilled = json.loads((run / "distill/metrics.json").read_text())["epochs"]
    alone = json.loads((run / "distill/baseline/metrics.json").read_text())["epochs"][-1]["val_acc"]
    assert m["epoch_passing_alone"] == epoch_passing(distilled, alone), (m, distilled, alone)


def test_with_mixing_the_report_says_the_student_alone_was_mixed_too(teacher_run, tiny_config, tmp_path):
    """The student alone gets the same mixing as the distilled one, which can handicap it (mixup cost it 2-4 points
    on cifar10-dev): the stated gain must say so, and name the run to compare with."""
    run = copy_of(teacher_run, tmp_path)
    proc = distill(run, tiny_config, "distill.mix=mixup", "distill.baseline=true", in_process=True)
    assert proc.returncode == 0, proc.stderr
    assert metrics(run)["mix"] == "mixup"
    report = (run / "report.md").read_text()
    assert "Both students trained on mixup-mixed images" in report and "distill.mix=none" in report
    proc = distill(run, tiny_config, "distill.baseline=true", in_process=True)  # no mixing: no such sentence
    assert proc.returncode == 0, proc.stderr
    assert metrics(run)["mix"] == "none" and "mixed images" not in (run / "report.md").read_text()


def test_an_unlabelled_folder_without_images_or_with_a_broken_one_is_one_clear_error(teacher_run, tiny_config,
                                                                                      tmp_path, unlabeled):
    run = copy_of(teacher_run, tmp_path)
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("no images here")
    proc = distill(run, tiny_config, f"data.unlabeled={empty}", in_process=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"data.unlabeled: folder '{empty}' holds no image files" in proc.stderr
    missing = tmp_path / "missing"
    proc = distill(run, tiny_config, f"data.unlabeled={missing}", in_process=True)
    assert proc.returncode == 2 and f"data.unlabeled: folder '{missing}' does not exist" in proc.stderr
    broken = tmp_path / "broken"
    shutil.copytree(unlabeled, broken)
    (broken / "batch1" / "bad.png").write_bytes(b"not a png at all")
    proc = distill(run, tiny_config, f"data.unlabeled={broken}", in_process=True)
    assert proc.returncode == 2 and f"cannot read image '{broken / 'batch1' / 'bad.png'}'" in proc.stderr
    assert "distill" not in json.loads((run / "manifest.json").read_text())["stages"]  # nothing was written


def test_unlabelled_files_that_are_not_images_stop_the_run_before_the_teacher_trains(tiny_config, tmp_path,
                                                                                        unlabeled):
    """Unlabelled images' headers are read up front, before the teacher trains (half an hour in the cifar10 recipe),
    and every bad file is named in one sentence, so one run finds them all."""
    broken = tmp_path / "broken"
    shutil.copytree(unlabeled, broken)
    (broken / "batch1" / "bad.png").write_bytes(b"not a png at all")
    (broken / "empty.jpg").write_bytes(b"")
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--set", f"data.unlabeled={broken}")
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = next(x for x in result.stderr.splitlines() if "data.unlabeled" in x)
    assert str(broken / "batch1" / "bad.png") in line and str(broken / "empty.jpg") in line
    assert "1 more of the 42 files cannot be read either" in line
    assert not (tmp_path / "run").exists()


def test_truncated_unlabelled_images_are_all_named_when_distill_decodes_them(teacher_run, tiny_config, tmp_path,
                                                                             unlabeled):
    """A truncated image has a good header, so only decoding finds it: distill names every one, and writes
    nothing of its own."""
    run = copy_of(teacher_run, tmp_path)
    cut = tmp_path / "cut"
    shutil.copytree(unlabeled, cut)
    victims = [cut / "batch0" / "0.png", cut / "batch2" / "5.png"]
    for path in victims:
        path.write_bytes(path.read_bytes()[:60])  # the header survives, the pixels do not
    proc = distill(run, tiny_config, f"data.unlabeled={cut}", in_process=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"cannot read image '{victims[0]}' (OSError: image file is truncated)" in proc.stderr
    assert f"1 more of the 40 files cannot be read either: '{victims[1]}'" in proc.stderr
    assert "distill" not in json.loads((run / "manifest.json").read_text())["stages"]


def test_a_truncated_unlabelled_image_stops_a_full_run_before_the_teacher_trains(tiny_config, tmp_path, unlabeled):
    """A run that goes on to distill decodes data.unlabeled's images before the teacher trains: a truncated one
    (its header intact, so only decoding finds it) is named then, not after the teacher's hours."""
    cut = tmp_path / "cut"
    shutil.copytree(unlabeled, cut)
    victim = cut / "batch0" / "0.png"
    victim.write_bytes(victim.read_bytes()[:60])
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--set", f"data.unlabeled={cut}")
    assert result.exit_code == 2 and f"cannot read image '{victim}' (OSError: image file is truncated)" in result.stderr
    assert "teacher: decoding data.unlabeled's images first" in result.stderr
    assert not (tmp_path / "run" / "teacher" / "model.safetensors").exists()
    assert "teacher: epoch" not in result.stderr


def test_kill_9_with_unlabelled_images_resumes_bit_identically(teacher_run, tiny_config, tmp_path, unlabeled):
    """DIST (whose intra-class term relates the samples of a batch) with unlabelled images; every method is
    checked the same way by benchmarks/soak_methods.py."""
    settings = (f"data.unlabeled={unlabeled}", "distill.kd.method=dist")
    straight = copy_of(teacher_run, tmp_path, "straight")
    assert distill(straight, tiny_config, *settings, in_process=True).returncode == 0
    killed = copy_of(teacher_run, tmp_path, "killed")
    proc = distill(killed, tiny_config, *settings, fault="distill:1:12")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    again = distill(killed, tiny_config, *settings)
    assert again.returncode == 0 and "distill: resuming" in again.stderr, again.stderr
    assert same_weights(straight, killed)


def test_kill_9_while_building_the_store_resumes_the_build(teacher_run, tiny_config, tmp_path):
    three = "distill.epochs=3"  # three views, one chunk each (a store holds only views some epoch shows)
    straight = copy_of(teacher_run, tmp_path, "straight")
    assert distill(straight, tiny_config, three, in_process=True).returncode == 0
    killed = copy_of(teacher_run, tmp_path, "killed")
    proc = distill(killed, tiny_config, three, fault="store:2")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    chunks = sorted(n for n in os.listdir(killed / "distill" / "teacher_outputs") if n.startswith("chunk-"))
    assert chunks == ["chunk-000000.safetensors", "chunk-000001.safetensors"]  # two written (and in store.json)
    again = distill(killed, tiny_config, three)
    assert again.returncode == 0, again.stderr
    assert "resuming the build of the store" in again.stderr and "(2 of 3 chunks already built)" in again.stderr
    assert metrics(killed)["teacher_outputs"]["chunks_built"] == 1
    assert same_weights(straight, killed)


def test_two_processes_build_the_same_store_and_keep_replicas_identical(teacher_run, tiny_config, tmp_path,
                                                                         unlabeled):
    settings = (f"data.unlabeled={unlabeled}", "distill.kd.method=dkd")
    single = copy_of(teacher_run, tmp_path, "single")
    assert distill(single, tiny_config, *settings, in_process=True).returncode == 0
    double = copy_of(teacher_run, tmp_path, "double")
    proc = compress_subprocess("run", "-c", tiny_config, "--run-dir", double, "--stages", "distill",
                               "--nproc-per-node", "2", "--set", "teacher.epochs=3", "--set", "data.limit=600",
                               "--set", "distill.epochs=2",
                               "--set", "distill.hint.weight=0", "--set", "distill.baseline=false",
                               *[a for o in settings for a in ("--set", o)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics(double)
    assert m["replicas_identical"] is True and m["teacher_outputs"]["status"] == "build"
    folder = "distill/teacher_outputs"
    names = sorted(os.listdir(single / folder))
    assert names == sorted(os.listdir(double / folder))
    for name in names:  # computed by two processes (rank 0 writing), chunk for chunk the same bytes
        if name != "store.json":  # which records the build's seconds and process count
            assert (single / folder / name).read_bytes() == (double / folder / name).read_bytes(), name
    manifests = [json.loads((r / folder / "store.json").read_text()) for r in (single, double)]
    assert manifests[0]["chunks"] == manifests[1]["chunks"] and manifests[1]["last_build"]["processes"] == 2
    assert abs(m["val_acc"] - metrics(single)["val_acc"]) < 10


def test_the_student_alone_is_reused_when_only_the_teacher_or_the_losses_changed(teacher_run, tiny_config, tmp_path):
    """A distill rerun reuses the student trained alone - half of distill's time - when only the teacher or the
    distillation losses changed, as it depends on neither; reused, it is the one a fresh run would train."""
    run = copy_of(teacher_run, tmp_path)
    first = invoke("run", "-c", tiny_config, "--run-dir", run, "--stages", "distill", "--set", "teacher.epochs=3",
                   "--set", "data.limit=600", "--set", "distill.epochs=2", "--set", "distill.hint.weight=0")
    assert first.exit_code == 0, first.output
    alone = metrics(run)["baseline_val_acc"]
    again = invoke("run", "-c", tiny_config, "--run-dir", run, "--stages", "distill", "--set", "teacher.epochs=3",
                   "--set", "data.limit=600", "--set", "distill.epochs=2", "--set", "distill.hint.weight=0",
                   "--set", "distill.kd.method=dist", "--set", "data.cache_mb=512")  # how images are held: no matter
    assert again.exit_code == 0, again.output
    assert "distill: the student alone is the one an earlier run trained" in again.stderr
    assert metrics(run)["kd_method"] == "dist" and metrics(run)["baseline_val_acc"] == alone
    fresh = copy_of(teacher_run, tmp_path, "fresh")  # the same settings, no earlier student alone
    proc = distill(fresh, tiny_config, "distill.kd.method=dist", "distill.baseline=true", in_process=True)
    assert proc.returncode == 0 and metrics(fresh)["baseline_val_acc"] == alone
    x, _ = read_weights(run / "distill/baseline.safetensors")
    y, _ = read_weights(fresh / "distill/baseline.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    base = ["run", "-c", tiny_config, "--run-dir", run, "--stages", "distill", "--set", "teacher.epochs=3",
            "--set", "data.limit=600", "--set", "distill.epochs=2", "--set", "distill.hint.weight=0"]
    forced = invoke(*base, "--set", "distill.kd.method=dist", "--force")  # --force redoes the whole stage
    assert forced.exit_code == 0 and "the one an earlier run trained" not in forced.stderr
    path = run / "distill/baseline.safetensors"  # its bytes changed since the run that wrote it: trained again
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    flipped = invoke(*base, "--set", "distill.kd.method=hinton")
    assert flipped.exit_code == 0 and "the one an earlier run trained" not in flipped.stderr
    assert metrics(run)["baseline_val_acc"] == alone
    changed = invoke(*base, "--set", "distill.kd.method=dist", "--set", "distill.lr=0.02")
    assert changed.exit_code == 0 and "the one an earlier run trained" not in changed.stderr  # it depends on lr
    assert "distill: training the student alone again: its config (distill settings other than the losses, data, " \
           "model.student) changed since" in changed.stderr  # retraining it is said
    clipped = invoke(*base, "--set", "distill.kd.method=hinton", "--set", "distill.lr=0.02",
                     "--set", "train.clip_grad_norm=0.01")  # how the student alone is trained: not reused
    assert clipped.exit_code == 0 and "the one an earlier run trained" not in clipped.stderr
    assert "training the student alone again: train.clip_grad_norm changed since" in clipped.stderr


def test_distilled_student_holds_the_student_alone(finished_run):
    tensors, meta = read_weights(finished_run / "distill" / "model.safetensors")
    assert meta["stage"] == "distill" and meta["model"] == "compact_cnn"
    assert not any(k.startswith(("regressor", "module.", "student.")) for k in tensors)
    assert "classifier.weight" in tensors


def test_a_teacher_no_better_than_chance_is_named_before_distilling(tmp_path, tiny_config):
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher,distill",
                    "--set", "teacher.epochs=1", "--set", "teacher.lr=0.0000001", "--set", "distill.epochs=1")
    assert result.exit_code == 0, result.output
    assert "the teacher scores" in result.stderr
    assert "hardly better than chance (10.0% for 10 classes): distilling from it cannot help" in result.stderr
    # after the student alone: the gap in images, said as a likelihood, not a verdict
    assert re.search(r"distill: the teacher \(\d+\.\d\d%\) scored below the student trained alone \(\d+\.\d\d%, \d+ "
                     r"validation image\(s\) more right\): it may have less to teach than the labels", result.stderr), \
        result.stderr


def test_a_student_no_better_than_chance_is_named_with_what_to_change(tmp_path, tiny_config):
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher,distill",
                    "--set", "distill.epochs=1", "--set", "distill.lr=0.0000001")
    assert result.exit_code == 0, result.output
    assert "the teacher scores" not in result.stderr
    assert "distill: the distilled student scores" in result.stderr
    assert "train it longer (distill.epochs) or more gently (a lower distill.lr)" in result.stderr


def test_a_users_teacher_whose_code_changed_under_the_same_weights_rebuilds_the_store(tiny_config, tmp_path):
    """A teacher of the user's code, given as a weights file and not trained (teacher.epochs: 0): editing its code
    leaves the weights file - and the teacher stage's output - byte for byte the same, yet the teacher answers
    differently, so the stored outputs of the old code are not reused."""
    from safetensors.torch import save_file

    code = tmp_path / "my_teacher.py"
    source = ("import torch.nn as nn\n\nSCALE = {}\n\nclass Net(nn.Module):\n    def __init__(self, n):\n"
              "        super().__init__()\n        self.fc = nn.Linear(64, n)\n\n    def forward(self, x):\n"
              "        return self.fc(x.flatten(1)) * SCALE\n\ndef net(num_classes):\n    return Net(num_classes)\n")
    code.write_text(source.format("1.0"))
    torch.manual_seed(0)
    save_file({"fc.weight": torch.randn(10, 64) * 0.1, "fc.bias": torch.zeros(10)}, str(tmp_path / "t.safetensors"))
    args = ["run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher,distill", "--set",
            "model.teacher=my_teacher:net", "--set", f"model.teacher_weights={tmp_path / 't.safetensors'}",
            "--set", "teacher.epochs=0", "--set", "data.limit=200", "--set", "distill.epochs=1", "--set",
            "distill.hint.weight=0", "--set", "distill.baseline=false"]
    first = compress_subprocess(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    code.write_text(source.format("50.0"))
    second = compress_subprocess(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "distill: running again: the code of model.teacher changed" in second.stderr, second.stderr[-2000:]
    assert "the teacher's code changed" in second.stderr and "reusing the store" not in second.stderr, \
        second.stderr[-2000:]


def test_the_log_says_why_fewer_views_are_used_and_when_no_loss_runs_the_teacher(teacher_run, tiny_config, tmp_path):
    """distill.views=5 over 2 epochs: 2 are used, and the log says why (not a silent '2 view(s)'). With every
    distillation weight 0 the teacher is not run, and the log says so rather than 'runs on every batch'."""
    run = copy_of(teacher_run, tmp_path)
    proc = distill(run, tiny_config, "distill.views=5", in_process=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "distill: 2 of distill.views=5 view(s) per image are used: 2 epoch(s) show 2" in proc.stderr
    proc = distill(run, tiny_config, "distill.kd.weight=0", "distill.cosine.weight=0", in_process=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the teacher is not run: no loss needs it" in proc.stderr and "runs on every batch" not in proc.stderr


def test_the_students_layers_decide_how_it_trains_not_the_teachers(tmp_path, tiny_config):
    """train.precision auto keeps models built on depthwise convolutions in fp32 on a CPU (bf16 trains them
    slower); in distill the teacher only runs forward, so a MobileNet teacher leaves a dense student in bf16."""
    run = tmp_path / "run"
    result = invoke("run", "-c", tiny_config, "--run-dir", run, "--stages", "teacher,distill",
                    "--set", "model.teacher=torchvision:mobilenet_v3_small", "--set", "teacher.epochs=1",
                    "--set", "distill.epochs=1", "--set", "distill.hint.weight=0")
    assert result.exit_code == 0, result.output
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    teacher, distilled = stages["teacher"]["metrics"], stages["distill"]["metrics"]
    if cpu_bf16_support():
        assert teacher["precision"] == "fp32" and "depthwise convolutions" in teacher["precision_reason"], teacher
        assert distilled["precision"] == "bf16", distilled["precision_reason"]
    else:
        assert distilled["precision_reason"].endswith("no native bf16 (no avx512_bf16 or amx_bf16), so fp32")
