"""Weights files as users bring them (compress.models.weights): Lightning-style prefixes, a state dict under an
unknown key, weights made for 3-channel images, backbone-only weights, auxiliary heads. Pretrained starts by
name: `model.teacher_weights=torchvision:IMAGENET1K_V1` (or `pretrained`) is found in torch's cache
($TORCH_HOME/hub/checkpoints/, the file torchvision itself would download) and loaded offline; a name whose file
is not there is one sentence naming the file to place and where. The tests write the weights files themselves:
nothing here touches the network (COMPRESS_OFFLINE is set)."""

import os

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from compress.errors import InputError
from compress.models.registry import build_model
from compress.models.weights import load_pretrained, read_state_dict, weights_file
from conftest import invoke


def resnet18_state(num_classes=5, seed=0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=num_classes).state_dict()


def fresh_resnet18(num_classes=5):
    torch.manual_seed(123)  # not the weights' seed: a load that does nothing shows
    return torchvision.models.resnet18(num_classes=num_classes)


def same(a, b, skip=()):
    return all(torch.equal(v, b[k]) for k, v in a.items() if k not in skip)


@pytest.mark.parametrize("wrap", [
    lambda sd: {"state_dict": {f"model.{k}": v for k, v in sd.items()}, "epoch": 3},  # Lightning
    lambda sd: {f"net.{k}": v for k, v in sd.items()},
    lambda sd: {f"backbone.module.{k}": v for k, v in sd.items()},
    # only the keys that do not match share the prefix
    lambda sd: {(f"encoder.{k}" if k.startswith("layer4") else k): v for k, v in sd.items()},
], ids=["lightning-model", "net", "backbone-then-ddp", "encoder-on-unmatched"])
def test_a_checkpoint_of_the_right_architecture_loses_its_wrappers_prefix(tmp_path, wrap):
    state = resnet18_state()
    torch.save(wrap(state), tmp_path / "w.ckpt")
    model = fresh_resnet18()
    note = load_pretrained(model, str(tmp_path / "w.ckpt"), "model.teacher_weights")
    assert same(state, model.state_dict())
    assert "stripped from its keys" in note


def test_a_prefixed_checkpoint_of_another_architecture_says_every_key_has_the_prefix(tmp_path):
    torch.manual_seed(0)
    other = torchvision.models.resnet34(num_classes=5).state_dict()
    torch.save({"state_dict": {f"model.{k}": v for k, v in other.items()}}, tmp_path / "r34.ckpt")
    with pytest.raises(InputError) as e:
        load_pretrained(fresh_resnet18(), str(tmp_path / "r34.ckpt"), "model.teacher_weights")
    assert "every key in it starts with 'model.'" in str(e.value) and "another architecture" in str(e.value)
    assert str(e.value).startswith("model.teacher_weights: '")


@pytest.mark.parametrize("model_name, given, named", [
    ("torchvision:resnet18", "resnet34", "resnet34"),
    ("resnet10_half", "resnet50", "resnet50"),  # a registry student of the same family
    ("torchvision:mobilenet_v3_small", "mobilenet_v3_large", "mobilenet_v3_large"),
])
def test_weights_of_another_architecture_of_the_family_name_it_and_the_setting(tmp_path, model_name, given, named):
    torch.manual_seed(0)
    torch.save(torchvision.models.get_model(given, num_classes=1000).state_dict(), tmp_path / "other.pth")
    model = build_model(model_name, (3, 32, 32), 5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError) as e:
        load_pretrained(model, str(tmp_path / "other.pth"), "model.teacher_weights", model_name)
    assert (f"its keys and shapes are those of torchvision's {named}: set model.teacher=torchvision:{named}, "
            f"or give weights made for {model_name}") in str(e.value)
    assert same(before, model.state_dict())  # refused before the model was touched


def test_weights_of_no_known_architecture_ask_without_naming_one(tmp_path):
    torch.save(build_model("resnet10_half", (3, 32, 32), 5).state_dict(), tmp_path / "r10.pth")
    with pytest.raises(InputError) as e:
        load_pretrained(build_model("compact_cnn", (3, 32, 32), 5), str(tmp_path / "r10.pth"),
                        "model.student_weights", "compact_cnn")
    assert str(e.value).endswith("is it a checkpoint of another architecture?")
    assert "torchvision's" not in str(e.value)


def test_a_state_dict_under_an_unknown_key_is_found_and_none_or_several_are_named(tmp_path):
    state = resnet18_state()
    torch.save({"net": state, "epoch": 3, "best_acc": 0.9}, tmp_path / "net.pth")
    model = fresh_resnet18()
    note = load_pretrained(model, str(tmp_path / "net.pth"), "model.student_weights")
    assert same(state, model.state_dict())
    assert note.startswith("model.student_weights: loaded net.pth (its 'net' entry)")

    ema = resnet18_state(seed=1)  # a model and its EMA copy: the known key is taken, the other named as left aside
    torch.save({"model": state, "model_ema": ema}, tmp_path / "ema.pth")
    model = fresh_resnet18()
    note = load_pretrained(model, str(tmp_path / "ema.pth"), "model.student_weights")
    assert same(state, model.state_dict())
    assert ("loaded ema.pth (its 'model' entry; it also holds 'model_ema', left aside: to load that one, save it "
            "alone, e.g. torch.save(checkpoint['model_ema'], 'weights.pth'))") in note

    torch.save({"student": state, "teacher": state, "epoch": 3}, tmp_path / "two.pth")
    with pytest.raises(InputError, match=r"'[^']*two.pth' holds 2 state dicts \(under 'student', 'teacher'\)"):
        load_pretrained(fresh_resnet18(), str(tmp_path / "two.pth"), "model.student_weights")

    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "none.pth")
    with pytest.raises(InputError, match=r"holds no state dict .*its top-level keys are 'epoch', 'lr'"):
        load_pretrained(fresh_resnet18(), str(tmp_path / "none.pth"), "model.student_weights")


def test_weights_for_another_number_of_image_channels_say_so_and_what_to_set(tmp_path):
    torch.save(build_model("compact_cnn", (3, 8, 8), 10).state_dict(), tmp_path / "rgb.pth")
    with pytest.raises(InputError) as e:
        load_pretrained(build_model("compact_cnn", (1, 8, 8), 10), str(tmp_path / "rgb.pth"), "model.teacher_weights")
    message = str(e.value)
    assert "the weights expect 3-channel images and the data has 1 channel" in message
    assert "data.channels=3" in message and "another architecture" not in message


@pytest.mark.e2e
def test_weights_for_another_number_of_channels_fail_the_run_in_one_sentence(tmp_path, tiny_config):
    # the digits of the tiny config have 1 channel; the teacher's weights (Lightning-style) were made for 3
    rgb = build_model("resnet14", (3, 8, 8), 10).state_dict()
    torch.save({"state_dict": {f"model.{k}": v for k, v in rgb.items()}}, tmp_path / "rgb.ckpt")
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run",
                    "--set", f"model.teacher_weights={tmp_path / 'rgb.ckpt'}")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.stderr
    assert "the weights expect 3-channel images and the data has 1 channel; set data.channels=3" in result.stderr
    assert not (tmp_path / "run").exists()


def test_backbone_only_weights_load_and_the_head_is_trained_from_scratch(tmp_path):
    state = resnet18_state(num_classes=1000)
    torch.save({k: v for k, v in state.items() if not k.startswith("fc.")}, tmp_path / "backbone.pth")
    model = fresh_resnet18(num_classes=5)
    own_head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("fc.")}
    note = load_pretrained(model, str(tmp_path / "backbone.pth"), "model.student_weights")
    loaded = model.state_dict()
    assert same(state, loaded, skip=("fc.weight", "fc.bias"))
    assert same(own_head, loaded)
    assert "no classifier head (fc.bias, fc.weight)" in note and "(5, 512) is trained from scratch" in note

    # half a head is not a backbone: still refused, naming the key
    torch.save({k: v for k, v in resnet18_state().items() if k != "fc.bias"}, tmp_path / "half.pth")
    with pytest.raises(InputError, match=r"missing keys: fc.bias\)"):
        load_pretrained(fresh_resnet18(), str(tmp_path / "half.pth"), "model.student_weights")


def test_googlenet_weights_with_auxiliary_classifiers_load_into_the_model_built_without_them(tmp_path):
    """compress builds googlenet/inception_v3 without their training-only auxiliary heads (one tensor of scores);
    torchvision's files, which hold them, load all the same: the auxiliary tensors are left out, not refused as
    "unexpected keys: aux1..."."""
    with_aux = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=True, num_classes=5)
    torch.save(with_aux.state_dict(), tmp_path / "googlenet.pth")
    model = build_model("torchvision:googlenet", (3, 32, 32), 5)
    note = load_pretrained(model, str(tmp_path / "googlenet.pth"), "model.teacher_weights")
    assert "its auxiliary classifiers aux1, aux2 left out" in note
    assert torch.equal(model.state_dict()["fc.weight"], with_aux.state_dict()["fc.weight"])


def test_imagenet_resnet18_weights_into_the_registry_resnet18_name_the_stem(tmp_path):
    """ImageNet resnet18 weights loaded into the registry's resnet18 are refused naming the stem, not as another
    architecture: it is the same one, with a 3x3 stem for small images where torchvision's has a 7x7 one."""
    torch.save(torchvision.models.resnet18(weights=None, num_classes=1000).state_dict(), tmp_path / "imagenet.pth")
    with pytest.raises(InputError, match=r"the weights' first convolution is 7x7 and this model's 3x3: they were made "
                                         r"for another variant of this architecture \(torchvision's ImageNet weights "
                                         r"need the torchvision:<name> model"):
        load_pretrained(build_model("resnet18", (3, 32, 32), 10), str(tmp_path / "imagenet.pth"),
                        "model.teacher_weights")
    note = load_pretrained(build_model("torchvision:resnet18", (3, 32, 32), 10), str(tmp_path / "imagenet.pth"),
                           "model.teacher_weights")
    assert "was replaced by a new one of shape (10, 512)" in note


def test_state_dict_files_lose_wrapper_prefixes_and_nested_checkpoints_are_found(tmp_path):
    model = build_model("compact_cnn", (1, 8, 8), 10)
    wrapped = {"epoch": 3, "state_dict": {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}}
    torch.save(wrapped, tmp_path / "ckpt.pt")
    assert set(read_state_dict(str(tmp_path / "ckpt.pt"), "k")) == set(model.state_dict())
    fresh = build_model("compact_cnn", (1, 8, 8), 10)
    load_pretrained(fresh, str(tmp_path / "ckpt.pt"), "model.student_weights")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_a_mismatch_beyond_the_head_names_the_keys(tmp_path):
    torch.save(build_model("compact_cnn", (3, 8, 8), 10).state_dict(), tmp_path / "rgb.pth")
    with pytest.raises(InputError, match=r"does not fit this model \(wrong shape: stem.0.weight"):
        load_pretrained(build_model("compact_cnn", (1, 8, 8), 10), str(tmp_path / "rgb.pth"), "model.teacher_weights")


def test_a_weights_path_under_the_home_folder_is_read_where_the_checks_found_it(tmp_path, monkeypatch):
    # preflight and the run state expanded "~"; the loader did not, so the stage failed after the checks passed
    monkeypatch.setenv("HOME", str(tmp_path))
    model = build_model("compact_cnn", (1, 8, 8), 10)
    torch.save(model.state_dict(), tmp_path / "mine.pth")
    assert "loaded mine.pth" in load_pretrained(build_model("compact_cnn", (1, 8, 8), 10), "~/mine.pth", "model.x")


FILE = "mobilenet_v3_small-047dcff4.pth"  # the basename of MobileNet_V3_Small_Weights.IMAGENET1K_V1.url


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setenv("COMPRESS_OFFLINE", "1")
    return home


def place_imagenet_weights(home):
    torch.manual_seed(7)
    state = torchvision.models.mobilenet_v3_small(num_classes=1000).state_dict()
    path = home / "hub" / "checkpoints" / FILE
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return path, state


def test_a_torchvision_weights_name_is_the_file_in_torchs_cache_and_loads(torch_home):
    path, state = place_imagenet_weights(torch_home)
    for name in ("torchvision:IMAGENET1K_V1", "pretrained", "torchvision:DEFAULT",
                 "torchvision:MobileNet_V3_Small_Weights.IMAGENET1K_V1"):
        assert weights_file(name, "torchvision:mobilenet_v3_small", "model.teacher_weights", download=True) == \
            str(path)
    model = build_model("torchvision:mobilenet_v3_small", (3, 32, 32), 10)
    note = load_pretrained(model, str(path), "model.teacher_weights")
    assert "replaced by a new one of shape (10, 1024)" in note  # ImageNet's 1000-class head -> the data's 10
    loaded = model.state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in state.items() if not k.startswith("classifier.3"))


def test_a_weights_name_that_is_not_there_or_not_the_models_is_one_sentence(torch_home):
    with pytest.raises(InputError) as e:
        weights_file("pretrained", "torchvision:mobilenet_v3_small", "model.teacher_weights", download=True)
    assert str(e.value) == (
        "model.teacher_weights: torchvision's MobileNet_V3_Small_Weights.IMAGENET1K_V1 is not in torch's cache and "
        "COMPRESS_OFFLINE is set; download https://download.pytorch.org/models/mobilenet_v3_small-047dcff4.pth and "
        f"place it at {torch_home / 'hub' / 'checkpoints' / FILE} (or set TORCH_HOME to the folder whose "
        "hub/checkpoints/ holds it)")
    with pytest.raises(InputError, match=r"has no weights 'IMAGENET1K_V9'; choose one of torchvision:IMAGENET1K_V1, "
                                         r"torchvision:DEFAULT \(or pretrained\)"):
        weights_file("torchvision:IMAGENET1K_V9", "torchvision:mobilenet_v3_small", "model.teacher_weights")
    with pytest.raises(InputError, match=r"model.student is 'compact_cnn', not a torchvision model"):
        weights_file("pretrained", "compact_cnn", "model.student_weights")


def test_a_damaged_file_in_torchs_cache_is_named_with_how_to_get_it_again(torch_home, tmp_path):
    path = torch_home / "hub" / "checkpoints" / FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a download")
    with pytest.raises(InputError) as e:
        load_pretrained(build_model("torchvision:mobilenet_v3_small", (3, 32, 32), 10), str(path),
                        "model.teacher_weights")
    assert str(e.value) == (
        f"model.teacher_weights: '{path}' in torch's weights cache is not the file torchvision publishes (its "
        "sha256 does not begin with 047dcff4 as its name says: a damaged or different file); delete it and rerun to "
        "download it again, or place the right file there")
    elsewhere = tmp_path / FILE  # the same bytes outside the cache: the reader's own message, about the file
    elsewhere.write_bytes(b"half a download")
    with pytest.raises(InputError, match="is not a plain state dict"):
        load_pretrained(build_model("torchvision:mobilenet_v3_small", (3, 32, 32), 10), str(elsewhere), "model.x")


def test_the_normalisation_note_is_for_torchvision_weights_with_the_images_own_statistics():
    from compress.models.weights import normalisation_note
    from conftest import data_cfg

    own = data_cfg("data.name=digits")
    assert "not ImageNet's" in normalisation_note("pretrained", own)
    assert normalisation_note("torchvision:IMAGENET1K_V1", own).startswith("; your images are normalised")
    assert normalisation_note("/weights/teacher.pth", own) == ""  # a file: whatever it learned on, compress can't say
    given = data_cfg("data.name=digits", "data.mean=[0.485]", "data.std=[0.229]")
    assert normalisation_note("pretrained", given) == ""


def photo_folder(root):
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("val", 4)):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")


@pytest.mark.e2e
def test_a_run_starts_the_teacher_from_the_cached_weights_offline_or_says_what_to_place(torch_home, tmp_path):
    photo_folder(tmp_path / "photos")
    args = ["run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.name=imagefolder",
            "--set", f"data.root={tmp_path / 'photos'}", "--set", "data.image_size=32", "--set", "teacher.epochs=1",
            "--set", "teacher.batch_size=8", "--set", "model.teacher=torchvision:mobilenet_v3_small",
            "--set", "model.teacher_weights=torchvision:IMAGENET1K_V1", "--set", "train.progress=false"]
    missing = invoke(*args)
    assert missing.exit_code == 2 and "Traceback" not in missing.output
    assert f"download https://download.pytorch.org/models/{FILE} and place it at" in missing.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
    offline = invoke(*args, "--dry-run")  # COMPRESS_OFFLINE: the dry run refuses as the run does, in its words
    assert offline.exit_code == 2 and "COMPRESS_OFFLINE is set; download https://" in offline.stderr, offline.output
    os.environ.pop("COMPRESS_OFFLINE")  # (monkeypatch restores it) a dry run downloads nothing: it says a run would
    planned = invoke(*args, "--dry-run")
    assert planned.exit_code == 0, planned.output
    assert (f"note: model.teacher_weights: torchvision:IMAGENET1K_V1 is not in torch's cache yet; `compress run` "
            f"downloads it to {torch_home / 'hub' / 'checkpoints' / FILE} first") in planned.stdout
    assert "teacher  run" in planned.stdout and not (tmp_path / "run").exists()
    os.environ["COMPRESS_OFFLINE"] = "1"
    place_imagenet_weights(torch_home)  # random weights under torchvision's name: used as they are, with a warning
    ran = invoke(*args)
    assert ran.exit_code == 0, ran.output
    assert f"teacher: model.teacher_weights: loaded {FILE}" in ran.stderr
    assert ("your images are normalised with their own mean and std, not ImageNet's that these weights learned on "
            "(fine-tuning adapts to that; --set 'data.mean=[0.485, 0.456, 0.406]'") in ran.stderr
    assert f"{FILE}' in torch's weights cache is not the file torchvision publishes" in ran.stderr
    assert "note: model.teacher_weights" not in invoke(*args, "--dry-run").stdout
    assert "up to date, skipped" in invoke(*args).stderr  # the cached file's sha256 is the stage's input
    os.utime(torch_home / "hub" / "checkpoints" / FILE)  # touched, same bytes: still up to date
    assert "up to date, skipped" in invoke(*args).stderr


def unusable_copies(tmp_path):
    """resnet14's state dict (1-channel 8x8 images, 10 classes) saved as given, with every float tensor NaN, with
    one infinite value in one tensor (.safetensors), and with every tensor stored as int32."""
    from safetensors.torch import save_file

    state = build_model("resnet14", (1, 8, 8), 10).state_dict()
    torch.save(state, tmp_path / "good.pth")
    torch.save({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in state.items()},
               tmp_path / "nan.pth")
    inf = {k: v.clone() for k, v in state.items()}
    inf["classifier.bias"][3] = float("inf")
    save_file(inf, tmp_path / "inf.safetensors")
    torch.save({k: v.to(torch.int32) for k, v in state.items()}, tmp_path / "int.pth")
    return state


def test_weights_holding_nan_or_stored_as_integers_are_refused_naming_the_tensor(tmp_path):
    state = unusable_copies(tmp_path)
    floats = sum(v.is_floating_point() for v in state.values())
    for name, expected in (
            ("nan.pth", f"holds NaN or infinite values in stem.0.weight (and {floats - 1} more tensors); it cannot "
                        "be used as weights - pass another file"),
            ("inf.safetensors", "holds NaN or infinite values in classifier.bias; it cannot be used as weights - "
                                "pass another file"),
            ("int.pth", f"stores stem.0.weight (and {floats - 1} more tensors) as torch.int32 where the model has "
                        "floating-point weights; save the state dict with its float tensors")):
        with pytest.raises(InputError) as e:
            load_pretrained(build_model("resnet14", (1, 8, 8), 10), str(tmp_path / name), "model.teacher_weights")
        assert str(e.value) == f"model.teacher_weights: '{tmp_path / name}' {expected}"
    # integer buffers (BatchNorm's num_batches_tracked) are integers in the model too: the file as saved loads
    model = build_model("resnet14", (1, 8, 8), 10)
    load_pretrained(model, str(tmp_path / "good.pth"), "model.teacher_weights")
    assert same(state, model.state_dict())


def test_float64_weights_that_overflow_the_models_float32_are_refused_as_infinite(tmp_path):
    """1e300 is finite as stored (float64) and inf once cast to the model's float32: the teacher then predicted one
    class. The check is on the values the model would hold."""
    from safetensors.torch import save_file

    state = {k: v.double() if v.is_floating_point() else v
             for k, v in build_model("resnet14", (1, 8, 8), 10).state_dict().items()}
    state["classifier.bias"][0] = 1e300
    save_file(state, tmp_path / "huge.safetensors")
    with pytest.raises(InputError) as e:
        load_pretrained(build_model("resnet14", (1, 8, 8), 10), str(tmp_path / "huge.safetensors"),
                        "model.teacher_weights")
    assert str(e.value) == (f"model.teacher_weights: '{tmp_path / 'huge.safetensors'}' holds NaN or infinite values "
                            "in classifier.bias; it cannot be used as weights - pass another file")
    state["classifier.bias"][0] = 1e30  # float64 that fits float32 still loads
    save_file(state, tmp_path / "fits.safetensors")
    model = build_model("resnet14", (1, 8, 8), 10)
    load_pretrained(model, str(tmp_path / "fits.safetensors"), "model.teacher_weights")
    assert model.state_dict()["classifier.bias"][0] == torch.tensor(1e30, dtype=torch.float32)


def test_a_head_whose_bias_alone_does_not_fit_is_a_new_head_trained_from_scratch(tmp_path):
    """The right-shaped weight with a bias of another size: the whole head is the model's own new one and the note
    says so (preflight's `teacher.epochs: 0` guard reads it), not a fresh bias loaded silently."""
    state = resnet18_state()
    torch.save({**state, "fc.bias": torch.zeros(3)}, tmp_path / "bias.pth")
    model = fresh_resnet18()
    own_head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("fc.")}
    note = load_pretrained(model, str(tmp_path / "bias.pth"), "model.teacher_weights")
    assert note == ("model.teacher_weights: loaded bias.pth; its classifier head fc.bias (3,) was replaced by a new "
                    "one of shape (5,) (trained from scratch)")
    loaded = model.state_dict()
    assert same(state, loaded, skip=("fc.weight", "fc.bias")) and same(own_head, loaded)


def test_a_head_of_another_size_without_a_bias_is_replaced_whole():
    """A file whose classifier has another class count and no bias: the whole head is new anyway, so its missing
    bias is not a missing key."""
    import tempfile

    from torch import nn

    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3, bias=False))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))
    with tempfile.TemporaryDirectory() as folder:
        torch.save(other.state_dict(), os.path.join(folder, "nobias.pth"))
        note = load_pretrained(model, os.path.join(folder, "nobias.pth"), "model.teacher_weights")
    assert "its classifier head 2.weight (3, 8) was replaced by a new one of shape (10, 8)" in note
    assert torch.equal(model.state_dict()["0.weight"], other.state_dict()["0.weight"])


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
def test_sparse_or_meta_tensors_are_refused_naming_the_tensor(tmp_path):
    state = build_model("resnet14", (1, 8, 8), 10).state_dict()
    conv = state["stem.0.weight"]
    for name, tensor, expected in (
            ("sparse.pth", conv.to_sparse(), "holds stem.0.weight as a sparse_coo tensor, not a dense one; save the "
                                             "state dict with dense CPU tensors (`tensor.to_dense()`)"),
            ("meta.pth", torch.empty_like(conv, device="meta"),
             "holds stem.0.weight as a meta tensor (a shape without values); save the state dict of a model whose "
             "weights hold values, not one built on the meta device")):
        torch.save({**state, "stem.0.weight": tensor}, tmp_path / name)
        with pytest.raises(InputError) as e:
            load_pretrained(build_model("resnet14", (1, 8, 8), 10), str(tmp_path / name), "model.teacher_weights")
        assert str(e.value) == f"model.teacher_weights: '{tmp_path / name}' {expected}"


@pytest.mark.e2e
def test_a_teacher_of_nan_weights_taken_as_given_is_refused_before_anything_is_written(tmp_path, tiny_config):
    unusable_copies(tmp_path)
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher",
                    "--set", f"model.teacher_weights={tmp_path / 'nan.pth'}", "--set", "teacher.epochs=0")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert f"model.teacher_weights: '{tmp_path / 'nan.pth'}' holds NaN or infinite values in stem.0.weight" \
        in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_weights_path_that_is_a_device_a_pipe_or_a_folder_says_so(tmp_path):
    os.mkfifo(tmp_path / "pipe.pth")
    (tmp_path / "folder.pth").mkdir()
    for path in ("/dev/zero", str(tmp_path / "pipe.pth"), str(tmp_path / "folder.pth")):
        with pytest.raises(InputError) as e:
            load_pretrained(build_model("compact_cnn", (1, 8, 8), 10), path, "model.teacher_weights")
        assert str(e.value) == (f"model.teacher_weights: '{path}' is not a regular file (a device, pipe or folder); "
                                "pass a .safetensors or .pth file")
    with pytest.raises(InputError, match=r"^model.teacher_weights: weights file '.*absent.pth' not found$"):
        load_pretrained(build_model("compact_cnn", (1, 8, 8), 10), str(tmp_path / "absent.pth"),
                        "model.teacher_weights")
    with pytest.raises(InputError, match=r"weights file '.*imagenet' not found; torchvision's ImageNet weights are "
                                         r"named `pretrained` or `torchvision:IMAGENET1K_V1`$"):
        load_pretrained(build_model("compact_cnn", (1, 8, 8), 10), str(tmp_path / "imagenet"), "model.teacher_weights")


def test_a_state_dict_file_cut_short_is_named_damaged_not_a_different_kind_of_file(tmp_path):
    """A .pth that torch.save wrote, copied or downloaded only in part: 'damaged ... copy it again', not the advice
    for a file of another kind ('save model.state_dict()'), which would send the user the wrong way."""
    torch.save(build_model("compact_cnn", (1, 8, 8), 10).state_dict(), tmp_path / "whole.pth")
    data = (tmp_path / "whole.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[:len(data) // 2])
    with pytest.raises(InputError) as e:
        load_pretrained(build_model("compact_cnn", (1, 8, 8), 10), str(tmp_path / "cut.pth"), "model.teacher_weights")
    assert str(e.value).startswith(f"model.teacher_weights: '{tmp_path / 'cut.pth'}' is damaged or cut short (")
    assert str(e.value).endswith("); copy or download it again")


def test_a_download_whose_sha256_does_not_match_its_name_is_refused(torch_home, tmp_path, monkeypatch):
    """torch checks a download against the sha256 prefix in the weights file's name (resnet18-f37072fd.pth); a
    file that does not match (a damaged or substituted download) is refused and not left in the cache. Served
    from a local file:// address, through torch's own download code."""
    import types

    import compress.models.weights as weights

    served = tmp_path / "served" / "resnet18-f37072fd.pth"
    served.parent.mkdir()
    served.write_bytes(b"not the weights")
    monkeypatch.setenv("COMPRESS_OFFLINE", "0")
    monkeypatch.setattr(weights, "torchvision_weights", lambda value, model, key: types.SimpleNamespace(
        url=served.as_uri()))
    with pytest.raises(InputError, match=r"the downloaded file's sha256 does not begin with f37072fd as its name "
                                         r"says; download .*resnet18-f37072fd.pth and place it at"):
        weights.weights_file("pretrained", "torchvision:resnet18", "model.teacher_weights", download=True)
    assert not (torch_home / "hub" / "checkpoints" / "resnet18-f37072fd.pth").exists()


def test_a_file_in_torchs_cache_that_is_not_the_published_one_is_used_with_one_warning(torch_home, caplog,
                                                                                        monkeypatch):
    """torchvision checks the sha256 prefix in a weights file's name only when it downloads: a file placed in
    the cache under that name (random weights, another checkpoint) would load as "pretrained" unremarked. It is
    still used - placing one's own file there can be deliberate - with one warning naming it, the file hashed once
    however often the run looks it up."""
    import hashlib
    import logging

    import compress.models.weights as weights

    path, _ = place_imagenet_weights(torch_home)  # not torchvision's bytes: its sha256 does not begin with 047dcff4
    hashed, sha256_file = [], weights.sha256_file
    monkeypatch.setattr(weights, "sha256_file", lambda p, **kw: hashed.append(p) or sha256_file(p, **kw))
    with caplog.at_level(logging.WARNING, logger="compress.models.weights"):
        for _ in range(3):
            assert weights_file("pretrained", "torchvision:mobilenet_v3_small", "model.teacher_weights") == str(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"model.teacher_weights: '{path}' in torch's weights cache is not the file torchvision publishes (its sha256 "
        "does not begin with 047dcff4 as its name says), so it is loaded as it is; delete it and rerun to download "
        "the published weights, unless you placed it there on purpose"]
    assert hashed == [str(path)]
    assert weights.unpublished(str(path)) == "047dcff4"

    # a file whose sha256 does begin with the prefix in its name: nothing to say
    mine = torch_home / "hub" / "checkpoints" / "mine.pth"
    torch.save(resnet18_state(), mine)
    named = mine.with_name(f"mine-{hashlib.sha256(mine.read_bytes()).hexdigest()[:8]}.pth")
    mine.rename(named)
    assert weights.unpublished(str(named)) == "" and weights.unpublished(str(mine.with_name("notes.pth"))) == ""


def test_a_teacher_taken_as_given_says_what_head_its_file_has():
    """teacher.epochs: 0 with weights whose head is not for the data's classes: the sentence says the file's head
    is for 1000 classes (not that it has none), or that it has none, and that nothing would train a new one."""
    import tempfile

    from compress.models.weights import untrained_head_problem

    advice = "set teacher.epochs to 1 or more (or give weights whose head has these classes)"
    state = resnet18_state(num_classes=1000)
    with tempfile.TemporaryDirectory() as folder:
        files = {"imagenet.pth": state, "backbone.pth": {k: v for k, v in state.items() if not k.startswith("fc.")},
                 "four.pth": resnet18_state(num_classes=4)}
        notes = {}
        for name, saved in files.items():
            torch.save(saved, os.path.join(folder, name))
            notes[name] = load_pretrained(fresh_resnet18(4), os.path.join(folder, name), "model.teacher_weights")
    assert untrained_head_problem(notes["imagenet.pth"], "/x/imagenet.pth", 4) == (
        "teacher.epochs: 0 takes the teacher as given, but the classifier head in '/x/imagenet.pth' is for 1000 "
        f"classes and the data has 4: it needs a new head, and with teacher.epochs: 0 nothing would train it; {advice}")
    assert untrained_head_problem(notes["backbone.pth"], "/x/backbone.pth", 4) == (
        "teacher.epochs: 0 takes the teacher as given, but '/x/backbone.pth' has no classifier head for the data's 4 "
        f"classes, and with teacher.epochs: 0 nothing would train a new one; {advice}")
    assert untrained_head_problem(notes["four.pth"], "/x/four.pth", 4) == ""
