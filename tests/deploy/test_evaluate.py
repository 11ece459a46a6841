"""Predicting and evaluating with an exported file (compress.deploy.evaluate): PyTorch's labels, folders and
globs, and the export stage's own accuracy."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from compress.models.registry import build_model
from conftest import invoke, write_val_pngs

pytestmark = pytest.mark.e2e


def test_predict_gives_the_labels_pytorch_gives(finished_run, tmp_path):
    paths, x = write_val_pngs(tmp_path)
    model = build_model("compact_cnn", (1, 8, 8), 10).eval()
    from compress.training.checkpoint import load_weights
    load_weights(model, finished_run / "distill" / "model.safetensors")
    with torch.no_grad():
        expected = [str(i) for i in model(x).argmax(1).tolist()]
    result = invoke("predict", finished_run / "export" / "model.fp32.onnx", *paths, "--json", "--top-k", "2")
    assert result.exit_code == 0, result.output
    got = [entry["top"][0]["class"] for entry in json.loads(result.stdout)]
    assert got == expected


def test_predict_takes_folders_and_globs_and_skips_what_it_cannot_read(finished_run, tmp_path):
    from compress.data.builtin import _digits_arrays

    grey, _ = _digits_arrays()
    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    for i in range(3):
        Image.fromarray((grey[i] * 255 / 16).astype(np.uint8)).save(tmp_path / "imgs" / "sub" / f"{i}.png")
    (tmp_path / "imgs" / "broken.png").write_bytes(b"not an image")
    (tmp_path / "imgs" / "notes.txt").write_text("not an image by its name: left out, and counted")
    (tmp_path / "imgs" / "sub" / "anim.gif").write_bytes(b"GIF89a")
    result = invoke("predict", finished_run, tmp_path / "imgs", str(tmp_path / "imgs" / "sub" / "*.png"),
                    tmp_path / "photos")
    assert result.exit_code == 2
    assert result.stdout.count(": ") == 6  # three images from the folder, three from the glob
    assert f"skipped: cannot read image '{tmp_path / 'imgs' / 'broken.png'}'" in result.stderr
    assert f"skipped: '{tmp_path / 'photos'}' not found (no such file or folder)" in result.stderr
    assert "error: 2 of 8 image(s) could not be read" in result.stderr
    assert "note: left out 2 file(s) in the folders given that are not images compress reads (1 .gif, 1 .txt)" \
        in result.stderr
    deployed = json.loads((finished_run / "export" / "export.json").read_text())["verdict"]["file"]
    assert f"using {deployed}, export's choice" in result.stderr


def test_eval_on_the_validation_images_equals_the_export_stages_own_accuracy(finished_run, tmp_path):
    """The tiny run's validation digits written as lossless PNG class folders: eval (onnxruntime, the file's
    preprocessing) must find exactly the accuracy the export stage measured on the same images."""
    from compress.data.datasets import load_data
    from compress.run.config import load_config

    data = load_data(load_config(str(finished_run / "config.yaml")).data, 0)
    images, labels = data.val.raw(range(len(data.val)))
    for i, (image, label) in enumerate(zip(images, labels)):
        folder = tmp_path / "val" / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0].numpy()).save(folder / f"{i}.png")
    result = invoke("eval", finished_run / "export" / "model.int8.onnx", tmp_path / "val", "--json",
                    "--png", tmp_path / "confusion.png")
    assert result.exit_code == 0, result.output
    measured = json.loads(result.stdout)
    export = json.loads((finished_run / "export" / "export.json").read_text())
    assert measured["images"] == len(data.val) == export["int8"]["samples"]
    assert measured["top1"] == pytest.approx(export["int8"]["onnx_acc"], abs=1e-9)
    assert sum(map(sum, measured["confusion"])) == len(data.val) and measured["top5"] >= measured["top1"]
    assert len(measured["per_class"]) > 5  # with 5 classes or fewer top-5 is null: 100 % says nothing
    assert (tmp_path / "confusion.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_does_not_draw_over_a_file_of_the_run_directory(finished_run, tmp_path):
    """`--png RUN/report.png` would replace the pipeline's own chart with a confusion matrix: refused before the
    evaluation, the file untouched; a new name inside the run is fine."""
    paths, _ = write_val_pngs(tmp_path, count=1)
    (tmp_path / "val" / "3").mkdir(parents=True)
    Image.open(paths[0]).save(tmp_path / "val" / "3" / "x.png")
    before = (finished_run / "report.png").read_bytes()
    result = invoke("eval", finished_run, tmp_path / "val", "--png", finished_run / "report.png")
    assert result.exit_code == 2 and (finished_run / "report.png").read_bytes() == before
    assert (f"error: --png '{finished_run / 'report.png'}' is a file of the run directory '{finished_run}', which "
            "eval would overwrite; choose a new file name") in result.stderr
    os.symlink(finished_run / "report.png", tmp_path / "chart.png")  # a link to it is refused the same way
    result = invoke("eval", finished_run, tmp_path / "val", "--png", tmp_path / "chart.png")
    assert result.exit_code == 2 and (finished_run / "report.png").read_bytes() == before
    result = invoke("eval", finished_run, tmp_path / "val", "--png", finished_run / "export" / "confusion.png")
    assert result.exit_code == 0, result.output
    assert (finished_run / "export" / "confusion.png").read_bytes()[:4] == b"\x89PNG"
    (finished_run / "export" / "confusion.png").unlink()  # the run fixture is shared


def test_eval_says_which_files_it_did_not_read_and_which_classes_that_left_empty(finished_run, tmp_path):
    """A .gif is no image eval reads (as in training): counted in a note, with the class it left without images,
    rather than that class vanishing from the figures without a word."""
    paths, _ = write_val_pngs(tmp_path, count=1)
    for c in ("3", "7"):
        (tmp_path / "tree" / c).mkdir(parents=True)
    Image.open(paths[0]).save(tmp_path / "tree" / "3" / "x.gif")
    Image.open(paths[0]).save(tmp_path / "tree" / "7" / "x.png")
    result = invoke("eval", finished_run, tmp_path / "tree")
    assert result.exit_code == 0, result.output
    assert ("note: skipped 1 file(s) in the class folders that are not images compress reads (1 .gif); convert them "
            "to one of .jpg") in result.stderr
    assert "class folder(s) 3 hold no other image, so their accuracy is not measured" in result.stderr


def test_a_class_folder_mismatch_names_classes_on_one_line_and_a_split_folder_to_pass(tmp_path):
    """The model's class names come from its file: a line break in one must not print a line compress did not
    write. A folder holding only val/ is named as the folder to pass."""
    from compress.deploy.evaluate import labelled_tree
    from compress.errors import InputError

    (tmp_path / "val" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "val" / "cat" / "a.png")
    with pytest.raises(InputError) as caught:
        labelled_tree(str(tmp_path), ["cat", "b\nc"])
    message = str(caught.value)
    assert "\n" not in message and "the model's classes are cat, b\\nc" in message
    assert f"if '{tmp_path / 'val'}' holds the class folders, pass that" in message
    assert labelled_tree(str(tmp_path / "val"), ["cat", "b\nc"])[1] == [(str(tmp_path / "val" / "cat" / "a.png"), 0)]


def test_a_quoted_recursive_glob_reads_its_images_once_and_leaves_folders_and_other_files_out(tmp_path):
    """'imgs/**' matches imgs/, imgs/sub/ and every file: read as a folder is - each image once, the folders and
    the readme not taken for unreadable images."""
    from compress.deploy.evaluate import image_paths

    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    for name in ("a.png", "sub/b.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / name)
    (tmp_path / "imgs" / "readme.txt").write_text("x")
    expected = [str(tmp_path / "imgs" / "a.png"), str(tmp_path / "imgs" / "sub" / "b.png")]
    assert sorted(image_paths([str(tmp_path / "imgs" / "**")])) == expected
    assert sorted(image_paths([str(tmp_path / "imgs" / "*")])) == expected
    assert sorted(image_paths([str(tmp_path / "imgs" / "**" / "*.png")])) == expected
    # links back into the tree: glob would walk them without end (two) or name each image 40 times (one)
    (tmp_path / "imgs" / "l1").symlink_to(".")
    (tmp_path / "imgs" / "sub" / "l2").symlink_to("..")
    for pattern in ("**", os.path.join("**", "*.png"), os.path.join("s*", "**", "*.png")):
        found = image_paths([str(tmp_path / "imgs" / pattern)])
        assert len(found) == len({os.path.realpath(p) for p in found}), pattern  # each image once
        assert {os.path.realpath(p) for p in found} == {os.path.realpath(p) for p in expected
                                                         if pattern.startswith("**") or "sub" in p}, pattern


def test_eval_matches_class_folders_copied_from_macos_to_the_models_classes(tmp_path):
    """macOS writes café's é as e + a combining accent (NFD): the same class as the model's café (NFC)."""
    import unicodedata

    from compress.deploy.evaluate import labelled_tree

    for name in (unicodedata.normalize("NFD", "café"), "dog"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / name / "a.png")
    root, samples = labelled_tree(str(tmp_path), ["café", "dog"])
    assert sorted(label for _, label in samples) == [0, 1]
