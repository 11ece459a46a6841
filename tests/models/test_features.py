"""Hidden features by layer name (compress.models.features): hooks on an unmodified model, and a wrong name
answered with the layers there are."""

import pytest
import torch

from compress.errors import InputError
from compress.models.features import FeatureTap
from compress.models.registry import build_model
from compress.run.config import load_config


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
    """A long layer list (torchvision resnet18's 62) shows the top level first, so `avgpool` - the layer a user
    wants after the default `pool` is refused - is not cut off, and a near name is suggested."""
    from compress.distill.teacher import layer_problems
    from compress.models.features import layer_list

    model = build_model("torchvision:resnet18", (3, 32, 32), 10)
    assert layer_list(model).startswith("conv1, bn1, relu, maxpool, layer1, layer2, layer3, layer4, avgpool, fc at "
                                        "the top level; all: conv1, bn1,")
    d = load_config(None, ["distill.cosine.weight=1"]).distill  # cosine.teacher_layer: pool
    assert "the teacher has no layer 'pool'; did you mean 'maxpool' or 'avgpool'?" in layer_problems(d, None, model)[0]


def test_a_tapped_layer_keeps_its_own_output_when_the_next_layer_changes_it_in_place():
    """ResNet's bn1 is followed by ReLU(inplace=True): the tap holds bn1's output (negative values and all), not
    what the ReLU left in the same tensor - and gradients still flow through it."""
    torch.manual_seed(0)
    model = build_model("torchvision:resnet18", (3, 32, 32), 3).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model.bn1(model.conv1(x))  # before the tap: calling bn1 again would refill it
    assert float(expected.min()) < 0
    tap = FeatureTap(model, ["bn1"], role="teacher")
    try:
        with torch.no_grad():
            model(x)
        assert torch.equal(tap.outputs["bn1"], expected)
    finally:
        tap.remove()
    student = build_model("torchvision:resnet18", (3, 32, 32), 3).train()
    tap = FeatureTap(student, ["bn1"], role="student")
    try:
        student(x)
        tap.outputs["bn1"].sum().backward()
        assert student.conv1.weight.grad is not None
    finally:
        tap.remove()


def test_a_layer_never_called_or_returning_a_tuple_is_named_with_its_model_and_key():
    """A user's model may hold a module its forward never calls, or one returning a tuple (a GRU): each is one
    sentence naming the model's role and the keys to change, not a KeyError."""
    from torch import nn

    from compress.distill.teacher import feature_shapes

    class Student(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.spare, self.rnn = nn.Conv2d(1, 4, 3), nn.Linear(4, 4), nn.GRU(4, 4, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            h = self.conv(x).mean((2, 3))
            h, _ = self.rnn(h[:, None])
            return self.head(h[:, 0])

    teacher = build_model("compact_cnn", (1, 8, 8), 2)
    x = torch.zeros(2, 1, 8, 8)
    with pytest.raises(InputError, match=r"the student's layer 'spare' is never called in its forward pass.*"
                                         r"distill.cosine / distill.hint student_layer"):
        feature_shapes(Student(), teacher, ["spare"], [], x)
    with pytest.raises(InputError, match=r"the student's layer 'rnn' returns tuple, not a tensor"):
        feature_shapes(Student(), teacher, ["rnn"], [], x)
