"""An exported file as a deployment reads it (compress.deploy.onnx_model): its metadata, a file without any
refused unless asked, and a resize rule that disagrees with the graph's input refused in one sentence."""

import json

import onnx
import pytest

from compress.data.datasets import load_data
from compress.deploy.onnx_model import OnnxModel, metadata_of
from compress.errors import InputError
from compress.run.config import load_config
from conftest import invoke

pytestmark = pytest.mark.e2e


def onnx_with_resize(run, tmp, rule, input_shape=None):
    """The int8 file with its compress.resize metadata replaced by `rule` (and compress.input_shape by
    `input_shape`); its graph still takes 8x8 images."""
    from PIL import Image

    proto = onnx.load(run / "export" / "model.int8.onnx")
    for prop in proto.metadata_props:
        if prop.key == "compress.resize":
            prop.value = json.dumps(rule)
        if prop.key == "compress.input_shape" and input_shape:
            prop.value = json.dumps(input_shape)
    onnx.save(proto, tmp / "resized.onnx")
    Image.new("L", (8, 8), 128).save(tmp / "img.png")


SIXTEEN = {"shorter_side": 16, "height": 16, "width": 16, "interpolation": "bilinear", "antialias": True,
           "crop": "center"}


@pytest.mark.parametrize("rule, input_shape, message", [
    (SIXTEEN, None, "compress.resize crops 16x16 images, but the model's input is 8x8"),
    ({**SIXTEEN, "shorter_side": 4, "height": 8, "width": 8}, None,
     "compress.resize's shorter_side 4 is smaller than its 8x8 crop"),
    (SIXTEEN, [1, 16, 16], "compress.input_shape [1, 16, 16] disagrees with the graph's input [1, 8, 8]"),
])
def test_an_onnx_file_whose_resize_disagrees_with_its_input_is_refused(finished_run, tmp_path, rule, input_shape,
                                                                        message):
    """An ONNX file whose resize disagrees with its input shape is refused by predict and eval in one sentence that
    says to re-export, before onnxruntime fails on the pixels; a shorter side below the crop cannot be centre-cropped
    at all."""
    onnx_with_resize(finished_run, tmp_path, rule, input_shape)
    for args in (["predict", tmp_path / "resized.onnx", tmp_path / "img.png"],
                 ["eval", tmp_path / "resized.onnx", tmp_path]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert message in result.stderr and f"'{tmp_path / 'resized.onnx'}'" in result.stderr, result.stderr
        assert "re-export the model" in result.stderr and "Traceback" not in result.output


def test_metadata_round_trip(finished_run):
    meta = metadata_of(onnx.load(finished_run / "export" / "model.int8.onnx"))
    data = load_data(load_config(None, ["data.name=digits"]).data, seed=0)
    assert meta["class_names"] == list(data.class_names)
    assert meta["input_shape"] == [1, 8, 8] and meta["channel_order"] == "gray"
    assert meta["mean"] == pytest.approx(list(data.mean)) and meta["std"] == pytest.approx(list(data.std))
    assert meta["precision"] == "int8" and meta["qconfig"]["backend"] == "x86" and len(meta["source_sha256"]) == 64


def test_onnx_model_refuses_a_file_without_metadata_only_when_asked(finished_run, tmp_path):
    bare = tmp_path / "bare.onnx"
    proto = onnx.load(finished_run / "export" / "model.fp32.onnx")
    del proto.metadata_props[:]
    onnx.save(proto, bare)
    with pytest.raises(InputError):
        OnnxModel(str(bare))
    assert OnnxModel(str(bare), require_metadata=False).input_shape == (1, 8, 8)


@pytest.mark.parametrize("std", [[1e-300], [1e-4], [1e300]])
def test_an_onnx_file_whose_std_is_out_of_bounds_is_refused_before_any_pixel_is_normalised(finished_run, tmp_path,
                                                                                            std):
    """compress.std is held to the bounds of a config's data.std (MIN_STD): a tiny one is refused in one sentence
    naming the file and key, before numpy divides by it and prints a RuntimeWarning and a source line."""
    from PIL import Image

    from compress.run.schema import MIN_STD
    from conftest import compress_subprocess

    proto = onnx.load(finished_run / "export" / "model.int8.onnx")
    next(p for p in proto.metadata_props if p.key == "compress.std").value = json.dumps(std)
    onnx.save(proto, tmp_path / "std.onnx")
    Image.new("L", (8, 8), 128).save(tmp_path / "img.png")
    result = compress_subprocess("predict", tmp_path / "std.onnx", tmp_path / "img.png")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: '{tmp_path / 'std.onnx'}' metadata compress.std must hold values between {MIN_STD:g} and "
        f"{1 / MIN_STD:g}, as a config's data.std does; got {std}; re-export the model"), result.stderr
