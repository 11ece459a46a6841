"""Hostile input on the deployment side: an export.json or ONNX file edited to point outside the run, to lack
what a deployment reads, or to contradict itself. Each is refused with one sentence that names the file or key
and what to do, exit 2, no traceback, and every file in the run directory left byte-identical."""

import json

import onnx
import pytest

from conftest import invoke


def onnx_with_resize(run, tmp, rule):
    """The int8 file with its compress.resize metadata replaced by `rule` (its graph still takes 8x8 images)."""
    from PIL import Image

    proto = onnx.load(run / "export" / "model.int8.onnx")
    for prop in proto.metadata_props:
        if prop.key == "compress.resize":
            prop.value = json.dumps(rule)
    onnx.save(proto, tmp / "resized.onnx")
    Image.new("L", (8, 8), 128).save(tmp / "img.png")


@pytest.mark.parametrize("rule, message", [
    ({"shorter_side": 16, "height": 16, "width": 16, "interpolation": "bilinear", "antialias": True,
      "crop": "center"}, "compress.resize crops 16x16 images, but the model's input is 8x8"),
    ({"shorter_side": 4, "height": 8, "width": 8, "interpolation": "bilinear", "antialias": True,
      "crop": "center"}, "compress.resize's shorter_side 4 is smaller than its 8x8 crop"),
])
def test_an_onnx_file_whose_resize_disagrees_with_its_input_is_refused(finished_run, tmp_path, rule, message):
    """Was: predict cropped 16x16 pixels and onnxruntime failed on them ('unexpected ...', a traceback's last
    line); a shorter side below the crop cannot be centre-cropped at all."""
    onnx_with_resize(finished_run, tmp_path, rule)
    for args in (["predict", tmp_path / "resized.onnx", tmp_path / "img.png"],
                 ["eval", tmp_path / "resized.onnx", tmp_path]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert message in result.stderr and f"'{tmp_path / 'resized.onnx'}'" in result.stderr, result.stderr
        assert "re-export the model" in result.stderr and "Traceback" not in result.output
