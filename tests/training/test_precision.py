"""Precision and memory layout (compress.training.precision): bf16 only where it pays, and channels-last only
for a model that takes it."""

import json
import textwrap

import pytest
import torch
from torch import nn

from conftest import invoke


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


@pytest.mark.e2e
def test_a_user_model_that_cannot_take_channels_last_tensors_trains_in_the_default_layout(tmp_path, monkeypatch,
                                                                                          tiny_config):
    # teacher and distill train in channels-last (faster convolutions); `.view` on a feature map cannot take it
    (tmp_path / "viewy.py").write_text(textwrap.dedent("""\
        import torch.nn as nn

        class Viewy(nn.Module):
            def __init__(self, num_classes, in_channels):
                super().__init__()
                self.conv = nn.Conv2d(in_channels, 4, 3, padding=1)
                self.fc = nn.Linear(4 * 8 * 8, num_classes)

            def forward(self, x):
                x = self.conv(x).relu()
                return self.fc(x.view(x.size(0), -1))

        def build(num_classes, in_channels):
            return Viewy(num_classes, in_channels)
        """))
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher,distill",
                    "--set", "model.student=viewy:build", "--set", "distill.hint.weight=0",
                    "--set", "teacher.epochs=1", "--set", "distill.epochs=1")
    assert result.exit_code == 0, result.output
    stages = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]
    assert stages["teacher"]["metrics"]["memory_format"] == "channels_last"
    assert stages["distill"]["metrics"]["memory_format"] == "contiguous"
    assert stages["distill"]["metrics"]["val_acc"] > 0
