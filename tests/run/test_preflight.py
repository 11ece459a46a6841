"""Checks before anything is written (compress.run.preflight): a run directory inside the images, a split
folder given as the root, layers, weights and models that cannot work - each refused before the teacher
trains."""

import os
import textwrap

import pytest
import torch

from compress.errors import ConfigError
from compress.models.registry import build_model
from compress.run.config import load_config
from conftest import image_tree, invoke


@pytest.mark.e2e
def test_a_run_directory_inside_the_images_is_refused_before_anything_is_written(tmp_path):
    """A run directory inside the images (`cd ~/photos; compress run --set data.root=.`) is refused before anything
    is written: its artifacts among the class folders would be read as images, even as a class of report plots."""
    image_tree(tmp_path / "photos", splits=("",))
    for root, key in ((tmp_path / "photos", "data.root"), (tmp_path / "photos" / "cat", "data.unlabeled")):
        result = invoke("run", "--run-dir", tmp_path / "photos" / "cat" / "run", "--set", "data.name=imagefolder",
                        "--set", f"data.root={tmp_path / 'photos'}", "--set", f"{key}={root}", "--stages",
                        "teacher,distill")
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert (f"{key}: the run directory '{tmp_path / 'photos' / 'cat' / 'run'}' is inside '{root}', where its "
                "files would be read as images; pass --run-dir outside it") in result.stderr
    assert sorted(os.listdir(tmp_path / "photos" / "cat")) == [f"{i}.png" for i in range(4)]
    image_tree(tmp_path / "split")  # train/ and val/ are read, not what lies beside them
    beside = invoke("run", "--dry-run", "--run-dir", tmp_path / "split" / "artifacts", "--set", "data.name=imagefolder",
                    "--set", f"data.root={tmp_path / 'split'}")
    assert beside.exit_code == 0, beside.output


def test_a_root_that_does_not_exist_names_the_one_the_run_directory_holds(tmp_path):
    """`compress run -c photos --run-dir RUN`: the recipe's placeholder root is not the run's; the error names the
    root the run directory's config.yaml holds and how to keep it."""
    from compress.run.preflight import problems

    image_tree(tmp_path / "photos", splits=("",))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(f"data:\n  name: imagefolder\n  root: {tmp_path / 'photos'}\n")
    cfg = load_config(None, ["data.name=imagefolder", f"data.root={tmp_path / 'nowhere'}"])
    found = problems(cfg, ["teacher"], 1, str(tmp_path / "run"))
    assert found == [f"data.root: folder '{tmp_path / 'nowhere'}' does not exist; point data.root at the dataset (the "
                     f"run directory's config.yaml has data.root: {tmp_path / 'photos'}; without -c the run uses its "
                     f"own config, or --set data.root={tmp_path / 'photos'} keeps it)"], found
    assert problems(cfg, ["teacher"], 1, str(tmp_path / "elsewhere")) == [
        f"data.root: folder '{tmp_path / 'nowhere'}' does not exist; point data.root at the dataset"]


@pytest.mark.e2e
def test_a_split_folder_given_as_the_root_is_named(tmp_path):
    """A split folder given as data.root is named: the summary says it has siblings and how to use them, rather
    than split it silently."""
    image_tree(tmp_path / "img", count=10)
    result = invoke("run", "--dry-run", "--run-dir", tmp_path / "run", "--set", "data.name=imagefolder",
                    "--set", f"data.root={tmp_path / 'img' / 'train'}")
    assert f"point data.root at {tmp_path / 'img'} to use its splits as given" in result.output


@pytest.mark.e2e
@pytest.mark.parametrize("settings, expected", [
    (["distill.hint.student_layer=block7"], "distill.hint.student_layer: the student has no layer 'block7'"),
    (["distill.hint.teacher_layer=block7"], "distill.hint.teacher_layer: the teacher has no layer 'block7'"),
    (["distill.hint.student_layer=stem"], "distill.hint: student features"),
    (["distill.cosine.weight=1", "distill.cosine.student_layer=stem"], "distill.cosine: cannot reduce"),
])
def test_a_feature_loss_layer_that_cannot_work_fails_before_the_teacher_trains(tiny_config, tmp_path, settings,
                                                                                 expected):
    """A bad layer is refused before anything runs, not by distill after the teacher trained (half an hour in the
    cifar10 recipe)."""
    args = [a for s in settings for a in ("--set", s)]
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", *args)
    assert result.exit_code == 2, result.output
    assert expected in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_a_weights_file_that_cannot_load_fails_before_the_teacher_trains(tmp_path, tiny_config):
    # model.student_weights is read by the distill stage: a damaged or mismatched file is named before the teacher
    # stage trains (hours, at a user's scale); both are named at once, nothing written
    (tmp_path / "damaged.safetensors").write_bytes(b"not a safetensors file")
    torch.save(build_model("compact_cnn", (3, 8, 8), 10).state_dict(), tmp_path / "rgb.pth")
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--set", "model.teacher=compact_cnn",
                    "--set", f"model.teacher_weights={tmp_path / 'rgb.pth'}",
                    "--set", f"model.student_weights={tmp_path / 'damaged.safetensors'}")
    assert result.exit_code == 2, result.output
    assert "3 config errors" in result.stderr and "Traceback" not in result.stderr
    # the tiny config's hint reads the teacher's 'layers', which compact_cnn does not have: named in the same breath
    assert "distill.hint.teacher_layer: the teacher has no layer 'layers'" in result.stderr
    assert "model.teacher_weights: '" in result.stderr and "does not fit this model (wrong shape: stem.0.weight" \
        in result.stderr
    assert "model.student_weights: '" in result.stderr and "is not a readable safetensors file" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_user_model_that_does_not_give_class_scores_is_named_before_anything_runs(tmp_path, monkeypatch):
    """A user model that does not give class scores (a tuple out), ignores num_classes, or takes no arguments is
    named before anything runs, not by an unexpected error or a bare size mismatch mid-stage."""
    from compress.run.preflight import problems

    (tmp_path / "odd_models.py").write_text(textwrap.dedent("""\
        import torch.nn as nn

        class Pair(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
                self.fc = nn.Linear(8, n)

            def forward(self, x):
                h = self.body(x)
                return self.fc(h), h

        def pair(num_classes):
            return Pair(num_classes)

        def ten():  # takes no argument: gets none, and makes 10 classes
            return nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

        def gray(num_classes):
            return nn.Sequential(nn.Conv2d(1, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
        """))
    monkeypatch.chdir(tmp_path)
    image = tmp_path / "img"
    for cls in ("a", "b", "c"):
        (image / cls).mkdir(parents=True)
    expected = {
        "odd_models:pair": "returns a tuple for a batch of 2 images of 3x16x16 in training mode; compress needs one "
                           "tensor of class scores, of shape (2, 3)",
        "odd_models:ten": "returns a tensor of shape (2, 10) for a batch of 2 images of 3x16x16 in training mode; "
                          "compress needs class scores of shape (2, 3), for the data's 3 classes",
        "odd_models:gray": "fails on a batch of 2 images of 3x16x16 in training mode (RuntimeError: Given groups=1, ",
        "torchvision:googlenet": None,  # its auxiliary heads are off: one tensor while training too
    }
    for name, message in expected.items():
        cfg = load_config(None, ["data.name=imagefolder", f"data.root={image}", "data.image_size=16",
                                 f"model.student={name}"])
        found = problems(cfg, ["distill"], 1)
        if message is None:
            assert not any("model.student" in p for p in found), found
        else:
            assert any(p.startswith(f"model.student: {name} {message}") for p in found), found


def test_a_teacher_that_fails_on_the_images_is_a_config_error_with_feature_losses_too(tmp_path, monkeypatch):
    """With a feature loss on, the preflight does not probe a teacher its own check refused, and a teacher whose
    forward asserts on the image size is the config error (exit 2), not "unexpected AssertionError"."""
    from compress.run.preflight import problems

    (tmp_path / "sized.py").write_text(textwrap.dedent("""\
        import torch.nn as nn

        class Sized(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
                self.fc = nn.Linear(8, n)

            def forward(self, x):
                assert x.shape[-1] == 32, "Wrong image height!"
                return self.fc(self.features(x))

        def sized(num_classes):
            return Sized(num_classes)
        """))
    monkeypatch.chdir(tmp_path)
    image = tmp_path / "img"
    for cls in ("a", "b"):
        (image / cls).mkdir(parents=True)
    for stages in (["teacher", "distill"], ["distill"]):
        cfg = load_config(None, ["data.name=imagefolder", f"data.root={image}", "data.image_size=16",
                                 "model.teacher=sized:sized", "distill.hint.weight=1",
                                 "distill.hint.teacher_layer=features", "distill.hint.student_layer=block1"])
        found = problems(cfg, stages, 1)  # the probe raises nothing: what it finds is returned
        if "teacher" in stages:
            assert any(p.startswith("model.teacher: sized:sized fails on a batch of 2 images") for p in found), found
        else:  # the distill stage names it, with the checkpoint in hand
            assert not any("Wrong image height" in p for p in found), found


@pytest.mark.e2e
def test_a_model_torch_fx_cannot_trace_fails_before_any_training(tmp_path, monkeypatch):
    (tmp_path / "dynamic.py").write_text(textwrap.dedent("""\
        import torch.nn as nn

        class Branchy(nn.Module):
            def __init__(self, num_classes):
                super().__init__()
                self.fc = nn.Linear(64, num_classes)

            def forward(self, x):
                if x.sum() > 0:  # data-dependent control flow: not traceable
                    x = x * 2
                return self.fc(x.flatten(1))

        def build(num_classes):
            return Branchy(num_classes)
        """))
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "--run-dir", tmp_path / "run", "--set", "data.name=digits", "--set",
                    "model.student=dynamic:build")
    assert result.exit_code == 2
    assert "model.student: Branchy cannot be prepared for QAT by torch.fx" in result.stderr
    assert "--stages teacher,distill trains it in float" in result.stderr  # not "leave qat out": export needs it
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_a_teacher_taken_as_given_whose_head_would_be_new_is_refused(tmp_path, tiny_config):
    """teacher.epochs 0 with weights of another class count is refused: taken as given, the teacher would get an
    untrained head, and distill would learn from a teacher hardly better than chance."""
    teacher = build_model("resnet14", (1, 8, 8), 1000).state_dict()  # the tiny config's teacher, 1000 classes
    torch.save(teacher, tmp_path / "imagenet_head.pth")
    torch.save({k: v for k, v in teacher.items() if not k.startswith("classifier.")}, tmp_path / "backbone.pth")
    said = {"imagenet_head.pth": f"the classifier head in '{tmp_path / 'imagenet_head.pth'}' is for 1000 classes "
                                 "and the data has 10: it needs a new head, and with teacher.epochs: 0 nothing would "
                                 "train it; set teacher.epochs to 1 or more",
            "backbone.pth": f"'{tmp_path / 'backbone.pth'}' has no classifier head for the data's 10 classes, and "
                            "with teacher.epochs: 0 nothing would train a new one; set teacher.epochs to 1 or more"}
    for name, sentence in said.items():
        result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher",
                        "--set", f"model.teacher_weights={tmp_path / name}", "--set", "teacher.epochs=0")
        assert result.exit_code == 2 and "Traceback" not in result.stderr, result.output
        assert f"teacher.epochs: 0 takes the teacher as given, but {sentence}" in result.stderr, result.stderr
        assert not (tmp_path / "run").exists()
    trained = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher", "--dry-run",
                     "--set", f"model.teacher_weights={tmp_path / 'backbone.pth'}", "--set", "teacher.epochs=1")
    assert trained.exit_code == 0, trained.output  # trained, the new head is fine


def test_torchvision_weights_are_needed_only_by_the_stage_that_reads_them_and_offline_a_dry_run_refuses(
        tmp_path, monkeypatch):
    """model.teacher_weights=pretrained with nothing in torch's cache and COMPRESS_OFFLINE set: a run of the later
    stages (the teacher already trained) neither fetches nor needs them; one that trains the teacher refuses, and
    its dry run refuses in the same words rather than promise a download the run would not make."""
    from compress.run.preflight import check, problems

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("COMPRESS_OFFLINE", "1")
    cfg = load_config(None, ["data.name=digits", "model.teacher=torchvision:resnet18",
                             "model.teacher_weights=pretrained"])
    assert not any("teacher_weights" in p for p in problems(cfg, ["qat", "export"], 1))
    assert check(cfg, ["qat", "export"], 1, download=False)["weights"] == []
    (refused,) = [p for p in problems(cfg, ["teacher"], 1) if "teacher_weights" in p]
    assert "not in torch's cache and COMPRESS_OFFLINE is set" in refused
    with pytest.raises(ConfigError, match="COMPRESS_OFFLINE is set"):
        check(cfg, ["teacher"], 1, download=False)
    monkeypatch.delenv("COMPRESS_OFFLINE")
    (note,) = check(cfg, ["teacher"], 1, download=False)["weights"]
    assert "is not in torch's cache yet; `compress run` downloads it to" in note


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: --device cuda is fine")
def test_a_dry_run_refuses_device_cuda_without_a_cuda_device_as_the_run_does(tmp_path):
    result = invoke("run", "--dry-run", "--run-dir", tmp_path / "run", "--device", "cuda")
    assert result.exit_code == 2, result.output
    assert "train.device (--device): cuda was asked for but torch sees no CUDA device" in result.output
    assert not (tmp_path / "run").exists()
    ran = invoke("run", "--run-dir", tmp_path / "run", "--device", "cuda")  # one process: in the same words
    assert ran.exit_code == 2 and "error: config error: train.device (--device): cuda was asked for" in ran.stderr
    assert not (tmp_path / "run").exists()


def test_a_mean_and_std_for_other_channels_are_refused_by_the_dry_run_before_any_image_is_read(tmp_path):
    """The built-in digits have one channel: three means are refused up front (dry run and run alike), not after
    the images are loaded and the teacher stage has begun."""
    settings = ["--set", "data.mean=[0.5, 0.5, 0.5]", "--set", "data.std=[0.2, 0.2, 0.2]"]
    for dry in (["--dry-run"], []):
        result = invoke("run", *dry, "--run-dir", tmp_path / "run", *settings)
        assert result.exit_code == 2, result.output
        assert "data.mean/std have 3 values but the images have 1 channel(s); give one value per channel" in \
            result.stderr
        assert "teacher: running" not in result.stderr and not (tmp_path / "run").exists()
