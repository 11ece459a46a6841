"""The teacher stage (stages/teacher.py): a torchvision teacher taken as given, through distill and QAT to a
verified int8 file."""

import json
import textwrap

import numpy as np
import onnx
import pytest
import torch
import torchvision
from PIL import Image
from safetensors.torch import save_file

from compress.training.checkpoint import read_weights
from conftest import invoke

pytestmark = pytest.mark.e2e


def photo_folder(root, classes=("cat", "dog"), train=6, val=2):
    """Tiny train/val folders of non-square 'photos' (each class a different colour, so it can be learned)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for c, cls in enumerate(classes):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                base = np.zeros((72, 90, 3), np.uint8)
                base[..., c] = 200
                noise = rng.integers(0, 55, base.shape, dtype=np.uint8)
                Image.fromarray(base + noise).save(folder / f"{i}.jpg")
    return root


def test_torchvision_teacher_as_given_distils_a_pretrained_torchvision_student_to_int8_onnx(tmp_path):
    """The whole bring-your-own chain on the CPU: a torchvision resnet18 state dict written with torch.save is
    the teacher as it is (teacher.epochs: 0); a torchvision mobilenet_v2 student starts from a .safetensors
    file (an ImageNet-shaped one: its 1000-class head is replaced); distill, QAT with its stem kept float, and a
    verified int8 ONNX."""
    images = photo_folder(tmp_path / "photos")
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), tmp_path / "teacher.pth")
    save_file(torchvision.models.mobilenet_v2(num_classes=1000).state_dict(), str(tmp_path / "student.safetensors"))
    config = tmp_path / "byo.yaml"
    config.write_text(textwrap.dedent(f"""\
        data: {{name: imagefolder, root: {images}, image_size: 64, augment: random_resized_crop,
               crop_scale: [0.5, 1.0], eval_crop: 0.875}}
        model: {{teacher: "torchvision:resnet18", student: "torchvision:mobilenet_v2",
                teacher_weights: {tmp_path / "teacher.pth"}, student_weights: {tmp_path / "student.safetensors"}}}
        train: {{progress: false}}
        teacher: {{epochs: 0}}
        distill: {{epochs: 1, batch_size: 4, views: 2, baseline: false}}
        qat: {{epochs: 1, batch_size: 4, max_accuracy_drop: 100.0, float_layers: [features.0.0]}}
        export: {{latency_batch_sizes: [1, 2], latency_repeats: 2, latency_warmup: 0, min_int8_speedup: 0.0}}
        """))
    run = tmp_path / "run"
    result = invoke("run", "-c", config, "--run-dir", run)
    assert result.exit_code == 0, result.output
    assert "teacher torchvision:resnet18 used as given" in result.stderr
    assert "teacher: evaluates in " in result.stderr and "teacher: trains in" not in result.stderr  # nothing trained
    assert "its classifier head classifier.1.weight (1000, 1280) was replaced by a new one of shape (2, 1280)" \
        in result.stderr
    manifest = json.loads((run / "manifest.json").read_text())["stages"]
    assert manifest["teacher"]["metrics"]["trained"] is False and manifest["teacher"]["seconds"] < 60
    assert any(k.startswith("external:") and k.endswith("teacher.pth") for k in manifest["teacher"]["inputs"])
    _, meta = read_weights(run / "distill" / "model.safetensors")
    assert meta["model"] == "torchvision:mobilenet_v2" and meta["input_shape"] == [3, 64, 64]
    # train.precision auto keeps a student with depthwise convolutions in fp32 (bf16 is slower for them on a CPU)
    distilled = manifest["distill"]["metrics"]
    assert distilled["precision"] == "fp32", distilled["precision_reason"]
    assert distilled["precision_reason"].endswith(("depthwise convolutions (17 here) slower than fp32 on a CPU, "
                                                   "so fp32", "no native bf16 (no avx512_bf16 or amx_bf16), so fp32"))
    int8 = onnx.load(run / "export" / "model.int8.onnx")
    onnx.checker.check_model(int8, full_check=True)
    assert any(init.data_type == onnx.TensorProto.INT8 for init in int8.graph.initializer)
    export = json.loads((run / "export" / "export.json").read_text())
    assert export["int8"]["top1_agreement"] >= 0.75 and all(c["ok"] for c in export["checks"].values())
    # torchvision's stem convolution, named as the user names it, kept float in the int8 file (the latency-aware
    # automatic choice is tested with the real timer in tests/quant/test_mixed_precision.py)
    assert manifest["qat"]["metrics"]["float_layers"] == ["features.0.0"]
    weights = {i.name: i.data_type for i in int8.graph.initializer}
    convs = [weights.get(n.input[1]) for n in int8.graph.node if n.op_type == "Conv"]
    assert convs[0] == onnx.TensorProto.FLOAT and onnx.TensorProto.FLOAT not in convs[1:]  # the stem alone

    # changing the weights file reruns the teacher (its sha256 is an input of the stage)
    torch.manual_seed(1)
    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), tmp_path / "teacher.pth")
    again = invoke("run", "--run-dir", run, "--stages", "teacher")
    assert again.exit_code == 0 and "teacher: running again: its input" in again.stderr
