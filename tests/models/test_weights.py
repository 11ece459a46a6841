"""Weights files as users bring them (Lightning-style prefixes, a state dict under an unknown key, weights made for
3-channel images, backbone-only weights)."""


import pytest
import torch
import torchvision

from compress.errors import InputError
from compress.models.registry import build_model
from compress.models.weights import load_pretrained
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


def test_a_state_dict_under_an_unknown_key_is_found_and_none_or_several_are_named(tmp_path):
    state = resnet18_state()
    torch.save({"net": state, "epoch": 3, "best_acc": 0.9}, tmp_path / "net.pth")
    model = fresh_resnet18()
    load_pretrained(model, str(tmp_path / "net.pth"), "model.student_weights")
    assert same(state, model.state_dict())

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


def test_a_teacher_taken_as_given_whose_head_would_be_new_is_refused(tmp_path, tiny_config):
    """Was: teacher.epochs 0 with 1000-class weights replaced the head with an untrained one and went on ("used
    as given: val acc 31.11 %"); distill then only said the teacher was hardly better than chance."""
    teacher = build_model("resnet14", (1, 8, 8), 1000).state_dict()  # the tiny config's teacher, 1000 classes
    torch.save(teacher, tmp_path / "imagenet_head.pth")
    torch.save({k: v for k, v in teacher.items() if not k.startswith("classifier.")}, tmp_path / "backbone.pth")
    for name in ("imagenet_head.pth", "backbone.pth"):
        result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher",
                        "--set", f"model.teacher_weights={tmp_path / name}", "--set", "teacher.epochs=0")
        assert result.exit_code == 2 and "Traceback" not in result.stderr, result.output
        assert (f"teacher.epochs: 0 takes the teacher as given, but '{tmp_path / name}' has no classifier head for "
                "the data's 10 classes, and a new one would never be trained; set teacher.epochs to 1 or more") \
            in result.stderr
        assert not (tmp_path / "run").exists()
    trained = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher", "--dry-run",
                     "--set", f"model.teacher_weights={tmp_path / 'backbone.pth'}", "--set", "teacher.epochs=1")
    assert trained.exit_code == 0, trained.output  # trained, the new head is fine


def test_googlenet_weights_with_auxiliary_classifiers_load_into_the_model_built_without_them(tmp_path):
    """compress builds googlenet/inception_v3 without their training-only auxiliary heads (one tensor of scores);
    the review's point: torchvision's files, which hold them, were then refused as "unexpected keys: aux1..."."""
    with_aux = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=True, num_classes=5)
    torch.save(with_aux.state_dict(), tmp_path / "googlenet.pth")
    model = build_model("torchvision:googlenet", (3, 32, 32), 5)
    note = load_pretrained(model, str(tmp_path / "googlenet.pth"), "model.teacher_weights")
    assert "its auxiliary classifiers aux1, aux2 left out" in note
    assert torch.equal(model.state_dict()["fc.weight"], with_aux.state_dict()["fc.weight"])


def test_imagenet_resnet18_weights_into_the_registry_resnet18_name_the_stem(tmp_path):
    """Was: "conv1.weight (64, 3, 7, 7) vs (64, 3, 3, 3); is it a checkpoint of another architecture?" - it is
    the same architecture; the registry's resnet18 has a 3x3 stem for small images, torchvision's a 7x7 one."""
    torch.save(torchvision.models.resnet18(weights=None, num_classes=1000).state_dict(), tmp_path / "imagenet.pth")
    with pytest.raises(InputError, match=r"the weights' first convolution is 7x7 and this model's 3x3: they were made "
                                         r"for another variant of this architecture \(torchvision's ImageNet weights "
                                         r"need the torchvision:<name> model"):
        load_pretrained(build_model("resnet18", (3, 32, 32), 10), str(tmp_path / "imagenet.pth"),
                        "model.teacher_weights")
    note = load_pretrained(build_model("torchvision:resnet18", (3, 32, 32), 10), str(tmp_path / "imagenet.pth"),
                           "model.teacher_weights")
    assert "was replaced by a new one of shape (10, 512)" in note
