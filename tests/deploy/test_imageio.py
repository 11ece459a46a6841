"""The one eval-time image rule (compress.deploy.imageio): the shorter side resized and the centre cropped, as
the ONNX metadata says; 16-bit and float images scaled; a pipe never opened; class names escaped."""

import json
import os
import threading

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from compress.data.datasets import load_data
from compress.run.config import load_config
from conftest import compress_subprocess, data_cfg, invoke, sized_image_tree


def test_validation_images_are_resized_by_the_shorter_side_and_centre_cropped(tmp_path):
    """Not squashed: a 20x40 image keeps its aspect ratio. The expected pixels are computed here, from the file's
    own pixels: size 16 with eval_crop 0.8 means shorter side 20 (this image's already, so no resize), then the
    centre 16x16 - rows 2..17, columns 12..27."""
    sized_image_tree(tmp_path, ["train", "val"], size=(20, 40), count=2)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.eval_crop=0.8"), seed=0)
    assert data.resize == {"shorter_side": 20, "height": 16, "width": 16, "interpolation": "bilinear",
                           "antialias": True, "crop": "center"}
    images, _ = data.val.raw([0])
    original = np.asarray(Image.open(data.val.files[0]).convert("RGB"))
    assert torch.equal(images[0], torch.from_numpy(original[2:18, 12:28].copy()).permute(2, 0, 1))


def test_validation_images_larger_than_the_rule_are_resized_with_pillows_bilinear_then_cropped(tmp_path):
    """A 40x80 image: shorter side 40 -> 20 (so 20x40, by Pillow's own bilinear resize), then the centre 16x16."""
    sized_image_tree(tmp_path, ["train", "val"], size=(40, 80), count=2)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.eval_crop=0.8"), seed=0)
    images, _ = data.val.raw([1])
    resized = np.asarray(Image.open(data.val.files[1]).convert("RGB").resize((40, 20), Image.BILINEAR))
    assert torch.equal(images[0], torch.from_numpy(resized[2:18, 12:28].copy()).permute(2, 0, 1))


def test_an_image_already_at_the_models_size_is_zoomed_and_cropped_like_the_metadata_says(tmp_path):
    """A 16x16 image with eval_crop 0.8 is resized (shorter side 20) and centre-cropped to 16x16, as the ONNX file's
    metadata and the README's snippet do, so predict, eval and the validation accuracy see the pixels a deployment
    sees (used as is, the accuracies differ: 26.35 % vs 25.10 %)."""
    sized_image_tree(tmp_path, ["train", "val"], size=(16, 16), count=2)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.eval_crop=0.8"), seed=0)
    images, _ = data.val.raw([0])
    resized = np.asarray(Image.open(data.val.files[0]).convert("RGB").resize((20, 20), Image.BILINEAR))
    assert torch.equal(images[0], torch.from_numpy(resized[2:18, 2:18].copy()).permute(2, 0, 1))
    kept = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.eval_crop=0.8", "data.augment=random_resized_crop"), seed=0)  # originals kept
    resized = np.asarray(Image.open(kept.train.files[0]).convert("RGB").resize((20, 20), Image.BILINEAR))
    assert torch.equal(kept.train.raw([0])[0][0], torch.from_numpy(resized[2:18, 2:18].copy()).permute(2, 0, 1))
    same = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16"), seed=0)
    original = np.asarray(Image.open(same.val.files[0]).convert("RGB"))  # eval_crop 1: the image as it is
    assert torch.equal(same.val.raw([0])[0][0], torch.from_numpy(original.copy()).permute(2, 0, 1))


def test_a_named_pipe_given_as_an_image_is_refused_without_blocking(finished_run, tmp_path):
    """`compress predict model.onnx some.fifo` refuses the pipe rather than block forever waiting for a writer."""
    fifo = tmp_path / "image.png"
    os.mkfifo(fifo)
    opened = threading.Event()

    def writer():  # if predict ever opens the pipe for reading, this unblocks it (and the test sees it)
        with open(fifo, "wb") as f:
            opened.set()
            f.write(b"")

    threading.Thread(target=writer, daemon=True).start()
    proc = compress_subprocess("predict", finished_run / "export" / "model.int8.onnx", fifo, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"image '{fifo}' is not a regular file (a pipe, device or socket)" in proc.stderr
    assert not opened.is_set(), "the pipe was opened"
    with open(fifo, "rb"):  # let the writer thread finish
        pass


def _val_digit(tmp_path):
    data = load_data(load_config(None, ["data.name=digits"]).data, seed=0)
    images, _ = data.val.raw([3])
    return images[0, 0].numpy()


def test_16_bit_and_float_images_are_scaled_not_clipped(finished_run, tmp_path):
    pixels = _val_digit(tmp_path)
    Image.fromarray(pixels).save(tmp_path / "eight.png")
    Image.fromarray(pixels.astype(np.uint16) * 257).save(tmp_path / "sixteen.png")
    Image.fromarray(pixels.astype(np.float32) / 255.0, mode="F").save(tmp_path / "float.tiff")
    assert Image.open(tmp_path / "sixteen.png").mode.startswith("I")
    model = finished_run / "export" / "model.fp32.onnx"
    result = invoke("predict", model, tmp_path / "eight.png", tmp_path / "sixteen.png", tmp_path / "float.tiff",
                    "--json", "--top-k", "3")
    assert result.exit_code == 0, result.output
    tops = [[(t["class"], round(t["probability"], 4)) for t in entry["top"]] for entry in json.loads(result.stdout)]
    assert tops[0] == tops[1] == tops[2]


def test_class_names_are_sanitised_before_printing(finished_run, tmp_path):
    proto = onnx.load(finished_run / "export" / "model.fp32.onnx")
    for prop in proto.metadata_props:
        if prop.key == "compress.class_names":
            prop.value = json.dumps(["\x1b[31mred\x1b[0m"] * 10)
    onnx.save(proto, tmp_path / "m.onnx")
    Image.fromarray(_val_digit(tmp_path)).save(tmp_path / "d.png")
    result = invoke("predict", tmp_path / "m.onnx", tmp_path / "d.png")
    assert result.exit_code == 0
    assert "\x1b" not in result.output and "\\x1b[31mred" in result.output



def test_an_empty_file_is_named_as_empty(tmp_path):
    from compress.deploy.imageio import open_image
    from compress.errors import InputError

    (tmp_path / "empty.jpg").write_bytes(b"")
    with pytest.raises(InputError) as e:
        open_image(str(tmp_path / "empty.jpg"))
    path = tmp_path / "empty.jpg"
    assert str(e.value) == f"cannot read image '{path}' (the file is empty: 0 bytes); fix or remove it"


def test_an_image_pillow_cannot_convert_is_skipped_like_an_unreadable_one(finished_run, tmp_path):
    """A LAB TIFF decodes, but Pillow has no conversion from LAB to grayscale (the digits model's one channel):
    predict names it as unreadable and still classifies the others, instead of aborting on Pillow's ValueError."""
    Image.new("LAB", (28, 28)).save(tmp_path / "lab.tif")
    Image.fromarray(_val_digit(tmp_path)).save(tmp_path / "digit.png")
    model = finished_run / "export" / "model.fp32.onnx"
    result = invoke("predict", model, tmp_path / "lab.tif", tmp_path / "digit.png")
    assert result.exit_code == 2, result.output
    assert (f"skipped: cannot read image '{tmp_path / 'lab.tif'}' (ValueError: conversion from LAB to RGB not "
            "supported); fix or remove it") in result.stderr
    assert f"{tmp_path / 'digit.png'}: " in result.stdout and "unexpected" not in result.stderr


def test_a_108_megapixel_photo_is_read_and_a_bomb_still_refused(tmp_path):
    """Pillow warns at 89 megapixels; a 108-megapixel phone photo (12000 x 9000) is a photo, not a bomb, and its
    header is read. One that claims 20000 x 10000 (past Pillow's own refusal) is refused in one sentence."""
    from compress.deploy.imageio import open_image
    from compress.errors import InputError
    from tests.test_bad_inputs import png_claiming_size

    png_claiming_size(tmp_path / "phone.png", 12000, 9000)
    assert open_image(tmp_path / "phone.png", decode=False).size == (12000, 9000)
    png_claiming_size(tmp_path / "bomb.png", 20000, 10000)
    with pytest.raises(InputError, match="too large to decode safely"):
        open_image(tmp_path / "bomb.png", decode=False)
