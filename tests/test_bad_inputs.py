"""The bad-input table: every malformed input gets one clear line, the exit code of its kind (2 bad input,
1 a failed check), no traceback, and leaves every file already in the run directory byte-identical."""

import json
import os
import shutil
import struct
import zlib

import onnx
import pytest
from safetensors.torch import save_file

from compress.fileio import sha256_file
from compress.training.checkpoint import read_weights
from conftest import file_bytes, invoke

pytestmark = pytest.mark.e2e


def write(path, text):
    path.write_text(text)
    return path


def edit_manifest(run, fn):
    path = run / "manifest.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x55
    path.write_bytes(bytes(data))


def as_half_precision(run):
    """A consistent but foreign file: fp16 weights, manifest updated to its sha256."""
    rel = "teacher/model.safetensors"
    tensors, meta = read_weights(run / rel)
    save_file({k: v.half() for k, v in tensors.items()}, str(run / rel),
              metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
    sha = sha256_file(run / rel)
    edit_manifest(run, lambda m: m["stages"]["teacher"]["outputs"].__setitem__(rel, sha))


def strip_onnx_metadata(run, tmp):
    proto = onnx.load(run / "export" / "model.int8.onnx")
    del proto.metadata_props[:]
    onnx.save(proto, tmp / "bare.onnx")


def edit_onnx_metadata(run, tmp, key, value):
    proto = onnx.load(run / "export" / "model.int8.onnx")
    for prop in proto.metadata_props:
        if prop.key == f"compress.{key}":
            prop.value = value
    onnx.save(proto, tmp / "edited.onnx")
    write_png(tmp / "img.png")


def edit_resize(run, tmp, **changes):
    """The int8 file with its compress.resize rule changed as given (its crop kept)."""
    proto = onnx.load(run / "export" / "model.int8.onnx")
    prop = next(p for p in proto.metadata_props if p.key == "compress.resize")
    prop.value = json.dumps({**json.loads(prop.value), **changes})
    onnx.save(proto, tmp / "edited.onnx")
    write_png(tmp / "img.png")


def write_png(path, size=8):
    from PIL import Image

    Image.new("L", (size, size), 128).save(path)


def png_claiming_size(path, width, height):
    """A tiny PNG whose header claims width x height pixels (a decompression bomb's calling card)."""
    write_png(path)
    data = bytearray(path.read_bytes())
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr:ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13:ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4:ihdr + 13])))
    path.write_bytes(bytes(data))


def save_with_external_data(run, tmp):
    """The int8 file with its weights moved to a separate file beside it (ONNX external data)."""
    proto = onnx.load(run / "export" / "model.int8.onnx")
    onnx.save_model(proto, tmp / "external.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    write_png(tmp / "img.png")


def write_line_png(path, width=20_000_000):
    """A real PNG one pixel high (20 KB): resized to any shorter side it would hold billions of pixels."""
    from PIL import Image

    Image.new("L", (width, 1), 128).save(path)


def save_other_architecture(tmp):
    import torch

    from compress.models.registry import build_model

    torch.save(build_model("light_cnn", (1, 8, 8), 10).state_dict(), tmp / "other.pth")


def save_pickled_module(tmp):
    import torch

    torch.save(torch.nn.Linear(2, 2), tmp / "module.pth")  # a whole pickled module, not a state dict


def link_inside(run, tmp):
    (tmp / "victim.txt").write_text("precious")
    os.symlink(tmp / "victim.txt", run / ".write-test")


# name: (setup(run, tmp) -> None, args(run, tmp) -> list, expected text in the error); exit code 2 unless
# EXIT_CODES says otherwise
def lock_not_writable(r):
    """A folder where the lock file goes: its open fails as on a read-only mount (root passes every permission
    check, so a chmod would not)."""
    if (r / ".lock").exists():
        (r / ".lock").unlink()
    (r / ".lock").mkdir()


CASES = {
    # run directories
    "run directory: a folder as its lock, report": (  # a sentence, not an OSError; the same one as `run`'s
        lambda r, t: lock_not_writable(r), lambda r, t: ["report", r],
        "has a folder where its file .lock goes; move the folder away and rerun"),
    "run directory: a folder as its lock, run": (  # `run` looks before it locks: the folder itself is named
        lambda r, t: lock_not_writable(r), lambda r, t: ["run", "--run-dir", r],
        "has a folder where its file .lock goes; move the folder away and rerun"),
    "run directory: under a file, dry run": (  # the plan is shown; the exit code says the run would stop
        lambda r, t: write(t / "f", "x"), lambda r, t: ["run", "--run-dir", t / "f" / "run", "--dry-run"],
        "is not a folder); choose another with --run-dir - `compress run` would stop here, before the plan above"),
    # config files
    "config: unknown key": (
        lambda r, t: write(t / "c.yaml", "teacher:\n  epoch: 3\n"),
        lambda r, t: ["run", "-c", t / "c.yaml", "--run-dir", r],
        "unknown key 'teacher.epoch' (did you mean 'teacher.epochs'?)"),
    "config: wrong type": (
        lambda r, t: write(t / "c.yaml", "teacher:\n  batch_size: big\n"),
        lambda r, t: ["run", "-c", t / "c.yaml", "--run-dir", r], "teacher.batch_size: expected a whole number"),
    "config: out of range": (
        lambda r, t: write(t / "c.yaml", "distill:\n  kd:\n    temperature: 0\n"),
        lambda r, t: ["run", "-c", t / "c.yaml", "--run-dir", r],
        "distill.kd.temperature: must be between 0.05 and 1000, or null, got 0.0"),
    "config: YAML syntax": (
        lambda r, t: write(t / "c.yaml", "teacher: [epochs\n"),
        lambda r, t: ["run", "-c", t / "c.yaml", "--run-dir", r], "YAML syntax error at line"),
    "config: missing file": (
        lambda r, t: None,
        lambda r, t: ["run", "-c", t / "absent.yaml", "--run-dir", r], "config file"),
    "config: a directory": (
        lambda r, t: (t / "confdir").mkdir(),
        lambda r, t: ["config", "-c", t / "confdir"], "is a directory"),
    "config: a list at the top": (
        lambda r, t: write(t / "c.yaml", "- teacher\n- distill\n"),
        lambda r, t: ["run", "-c", t / "c.yaml", "--run-dir", r], "expected a mapping of sections"),
    "config: binary file": (
        lambda r, t: (t / "c.yaml").write_bytes(b"\xff\xfe\x00\x81binary"),
        lambda r, t: ["run", "-c", t / "c.yaml", "--run-dir", r], "not UTF-8 text"),
    "config: section is not a mapping": (
        lambda r, t: write(t / "c.yaml", "teacher: 5\n"),
        lambda r, t: ["run", "-c", t / "c.yaml", "--run-dir", r], "teacher: expected a mapping of keys"),
    "config: unknown dataset": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--set", "data.name=mnist"], "unknown dataset 'mnist'"),
    "config: unknown model": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--set", "model.student=tiny"], "unknown model 'tiny'"),
    "config: missing dataset folder": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--set", "data.name=imagefolder", "--set", f"data.root={t}/nope"],
        "data.root: folder"),
    # command-line arguments
    "cli: unknown stage": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--stages", "teacher,quantize"],
        "unknown stage 'quantize'"),
    "cli: --set without =": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--set", "teacher.epochs"], "expected KEY=VALUE"),
    "cli: misspelled --set key": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--set", "qat.backnd=x86"],
        "did you mean 'qat.backend'"),
    "cli: zero processes": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--nproc-per-node", "0"], "--nproc-per-node"),
    "cli: cuda without a GPU": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--device", "cuda", "--force"], "no CUDA device"),
    "cli: unwritable run dir": (
        lambda r, t: write(t / "plainfile", "x"),
        lambda r, t: ["run", "--run-dir", t / "plainfile" / "run"], "cannot write to run directory"),
    "cli: show a folder that is no run": (
        lambda r, t: (t / "empty").mkdir(), lambda r, t: ["show", t / "empty"], "not a compress run directory"),
    # checkpoints
    "checkpoint: truncated": (
        lambda r, t: truncate(r / "teacher" / "model.safetensors"),
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--force"],
        "is truncated or not a safetensors file"),
    "checkpoint: edited bytes": (
        lambda r, t: flip_last_byte(r / "teacher" / "model.safetensors"),
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--force"], "was modified after it was written"),
    "checkpoint: replaced by hand, the stage reading it up to date": (  # never "up to date, skipped"
        lambda r, t: shutil.copyfile(r / "distill" / "baseline.safetensors", r / "distill" / "model.safetensors"),
        lambda r, t: ["run", "--run-dir", r, "--stages", "qat"], "was modified after it was written"),
    "checkpoint: another model": (  # no hint loss: its teacher layer, not in light_cnn, is refused before (below)
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--set", "model.teacher=light_cnn", "--set",
                      "distill.hint.weight=0"],
        "holds a 'resnet14' model but the config asks for 'light_cnn'"),
    "distill: a teacher layer the new model.teacher has not, the teacher stage not run": (  # before teacher trains
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--set", "model.teacher=light_cnn"],
        "distill.hint.teacher_layer: the teacher has no layer 'layers'; available layers: features"),
    "checkpoint: wrong dtype": (
        lambda r, t: as_half_precision(r),
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--force"], "wrong dtype"),
    "checkpoint: input missing": (
        lambda r, t: (r / "teacher" / "model.safetensors").unlink(),
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--force"], "run the teacher stage first"),
    "distill: wrong layer name": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--set", "distill.hint.student_layer=block7"],
        "the student has no layer 'block7'; did you mean 'block2' or 'block1' or 'block2.2'? available layers: stem"),
    "qat: a float layer the student has not": (  # refused, not ignored while listed as kept in float
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "qat", "--set", "qat.float_layers=[stem, nosuch]"],
        "qat.float_layers: compact_cnn (model.student) has no layer 'nosuch'; available layers: stem"),
    "qat: every layer float": (  # an int8 file without an int8 layer fails export's check after QAT trained
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "qat", "--set", "qat.float_layers=[stem, block1, block2, "
                      "classifier]"],
        "keeps every layer of model.student float (stem.0, block1.0.0, block2.0, classifier)"),
    "qat: one float layer not given as a list": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "qat", "--set", "qat.float_layers=stem"],
        "qat.float_layers: expected a list or null, got str 'stem' (a list of one: [stem])"),
    "distill: shapes that cannot match": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--set", "distill.hint.student_layer=stem"],
        "differ in spatial size"),
    "checkpoint: truncated QAT state": (
        lambda r, t: truncate(r / "qat" / "qat.safetensors"),
        lambda r, t: ["run", "--run-dir", r, "--stages", "export", "--force"],
        "is truncated or not a safetensors file"),
    # manifests
    "manifest: not JSON": (
        lambda r, t: write(r / "manifest.json", "{not json"),
        lambda r, t: ["run", "--run-dir", r], "is not valid JSON"),
    "manifest: wrong structure": (
        lambda r, t: write(r / "manifest.json", json.dumps({"format": "compress-run/1", "stages": []})),
        lambda r, t: ["run", "--run-dir", r], "is not a compress manifest"),
    "manifest: unknown status": (
        lambda r, t: edit_manifest(r, lambda m: m["stages"]["qat"].__setitem__("status", "great")),
        lambda r, t: ["show", r], "stage 'qat' has no valid status"),
    # ONNX files and images
    "onnx: missing": (
        lambda r, t: None, lambda r, t: ["bench", t / "none.onnx"], "not found"),
    "onnx: not ONNX": (
        lambda r, t: (t / "x.onnx").write_bytes(b"\x08\x07garbage"), lambda r, t: ["bench", t / "x.onnx"],
        "is not an ONNX model"),
    "onnx: no metadata": (
        strip_onnx_metadata, lambda r, t: ["predict", t / "bare.onnx", t / "img.png"],
        "has no compress metadata for class_names"),
    "image: unreadable": (
        lambda r, t: write(t / "img.png", "not a png"),
        lambda r, t: ["predict", r / "export" / "model.int8.onnx", t / "img.png"], "cannot read image"),
    "image: missing": (
        lambda r, t: None, lambda r, t: ["predict", r / "export" / "model.int8.onnx", t / "gone.png"], "not found"),
    "bench: bad batch list": (
        lambda r, t: None, lambda r, t: ["bench", r / "export" / "model.int8.onnx", "--batch", "1,x"],
        "positive whole numbers"),
    # found by trying the tool as a hostile but realistic user (issue 9)
    "cli: a batch that does not split over the processes": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--nproc-per-node", "3", "--force"],
        "teacher.batch_size: 32 does not split evenly over 3 processes"),
    "config: NaN accuracy budget": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "qat", "--set", "qat.max_accuracy_drop=nan"],
        "qat.max_accuracy_drop: expected a finite number"),
    "config: infinite std": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--set", "data.mean=[0.5]", "--set", "data.std=[.inf]"],
        "data.std[0]: expected a finite number"),
    "config: infinite learning rate": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--set", "teacher.lr=inf"],
        "teacher.lr: expected a finite number"),
    "config: absurd image size": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--set", "data.image_size=100000"],
        "data.image_size: must be between 8 and 2048"),
    "config: absurd seed": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--set", f"seed={10**23}"],
        "seed: 100000000000000000000000 is far too large"),
    "run dir: a symbolic link inside": (
        link_inside, lambda r, t: ["run", "--run-dir", r], "contains a symbolic link (.write-test)"),
    "manifest: malformed outputs": (
        lambda r, t: edit_manifest(r, lambda m: m["stages"]["teacher"]["outputs"].__setitem__("x", 5)),
        lambda r, t: ["run", "--run-dir", r, "--stages", "teacher"], "stage 'teacher' has malformed outputs"),
    "manifest: malformed metrics": (
        lambda r, t: edit_manifest(r, lambda m: m["stages"]["qat"].__setitem__("metrics", [1, 2])),
        lambda r, t: ["show", r], "stage 'qat' has a malformed \"metrics\""),
    "manifest: negative seconds": (
        lambda r, t: edit_manifest(r, lambda m: m["stages"]["teacher"].__setitem__("seconds", -5)),
        lambda r, t: ["show", r], "stage 'teacher' has \"seconds\" -5, which no run takes"),
    "manifest: no processes": (
        lambda r, t: edit_manifest(r, lambda m: m["stages"]["qat"].__setitem__("world_size", 0)),
        lambda r, t: ["show", r], "stage 'qat' has \"world_size\" 0, where a run has at least 1 process"),
    "manifest: a pipe that never ends": (
        lambda r, t: ((r / "manifest.json").unlink(), os.mkfifo(r / "manifest.json")),
        lambda r, t: ["run", "--run-dir", r, "--stages", "teacher"],
        "contains a pipe, manifest.json, where compress keeps only files and folders; remove it and rerun"),
    "bench: absurd repeats": (
        lambda r, t: None, lambda r, t: ["bench", r / "export" / "model.int8.onnx", "--repeats", "1000000000"],
        "Invalid value for '--repeats'"),
    "bench: absurd batch": (
        lambda r, t: None, lambda r, t: ["bench", r / "export" / "model.int8.onnx", "--batch", "10000000"],
        "positive whole numbers up to 4096"),
    "image: decompression bomb": (
        lambda r, t: png_claiming_size(t / "bomb.png", 60000, 60000),
        lambda r, t: ["predict", r / "export" / "model.int8.onnx", t / "bomb.png"], "too large to decode safely"),
    "onnx: mean of the wrong length": (
        lambda r, t: edit_onnx_metadata(r, t, "mean", "[0.1, 0.2, 0.3]"),
        lambda r, t: ["predict", t / "edited.onnx", t / "img.png"], "compress.mean must hold 1 finite number"),
    "onnx: weights in an external data file": (
        lambda r, t: save_with_external_data(r, t),
        lambda r, t: ["predict", t / "external.onnx", t / "img.png"],
        "keeps weights in a separate file (ONNX external data); compress reads only self-contained files"),
    "image: one pixel high, too long to resize": (
        lambda r, t: write_line_png(t / "line.png"),
        lambda r, t: ["predict", r, t / "line.png"], "is 20,000,000x1 pixels: with its shorter side resized to"),
    "onnx: a resize far beyond its crop": (
        lambda r, t: edit_resize(r, t, shorter_side=16384),
        lambda r, t: ["predict", t / "edited.onnx", t / "img.png"],
        "compress.resize's shorter_side 16384 is more than 4 times its"),
    "onnx: a resize rule compress does not apply": (
        lambda r, t: edit_resize(r, t, interpolation="nearest"),
        lambda r, t: ["predict", t / "edited.onnx", t / "img.png"],
        "compress.resize's interpolation is 'nearest', but compress resizes and crops one way (interpolation "
        "'bilinear')"),
    "onnx: std of zero": (
        lambda r, t: edit_onnx_metadata(r, t, "std", "[0.0]"),
        lambda r, t: ["predict", t / "edited.onnx", t / "img.png"], "compress.std must be positive"),
    "onnx: input shape of the wrong length": (
        lambda r, t: edit_onnx_metadata(r, t, "input_shape", "[8, 8]"),
        lambda r, t: ["predict", t / "edited.onnx", t / "img.png"], "compress.input_shape must be"),
    # bring your own model and weights (issue 12)
    "weights: another architecture": (
        lambda r, t: save_other_architecture(t),
        lambda r, t: ["run", "--run-dir", r, "--stages", "teacher", "--set", f"model.teacher_weights={t}/other.pth",
                      "--set", "teacher.epochs=0"],
        "model.teacher_weights: '"),
    "weights: a pickle that is not a plain state dict": (
        lambda r, t: save_pickled_module(t),
        lambda r, t: ["run", "--run-dir", r, "--stages", "teacher", "--set", f"model.teacher_weights={t}/module.pth",
                      "--set", "teacher.epochs=0"],
        "is not a plain state dict that torch.load(weights_only=True) can read (it holds a pickled "
        "torch.nn.modules.linear.Linear object, not only tensors)"),
    "weights: an image renamed .pth": (
        lambda r, t: (t / "photo.pth").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64)),
        lambda r, t: ["run", "--run-dir", r, "--stages", "teacher", "--set", f"model.teacher_weights={t}/photo.pth",
                      "--set", "teacher.epochs=0"],
        "can read (not a file torch.save wrote, or a damaged one)"),
    "weights: missing file": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--set", f"model.student_weights={t}/absent.safetensors"],
        "model.student_weights: weights file"),
    "weights: a device, not a file": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--set", "model.teacher_weights=/dev/zero"],
        "model.teacher_weights: '/dev/zero' is not a regular file (a device, pipe or folder); pass a .safetensors"),
    "model: unknown torchvision name": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--set", "model.teacher=torchvision:resnet19"],
        "torchvision has no classification model 'resnet19' (did you mean 'torchvision:resnet18'?)"),
    "model: module:function that does not exist": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--set", "model.student=compress.models.registry:nothing"],
        "module 'compress.models.registry' has no function 'nothing'"),
    "model: module that does not import": (
        lambda r, t: None, lambda r, t: ["run", "--run-dir", r, "--set", "model.student=no_such_module:build"],
        "cannot import module 'no_such_module' for model 'no_such_module:build' (No module named 'no_such_module'); a "
        "model is a registry name (compress models), torchvision:<builder>, or <module>:<function>"),
    "model: function that returns no nn.Module": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--set", "model.student=collections:OrderedDict"],
        "returned OrderedDict, not a torch.nn.Module"),
    # a stage that runs and fails its own check: exit 1, outputs kept for inspection
    "qat: accuracy budget exceeded": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "qat", "--set", "qat.optimizer=sgd", "--set", "qat.lr=3",
                      "--set", "qat.max_accuracy_drop=1"],
        "over the budget qat.max_accuracy_drop=1.0"),
    # a learning rate that blows the weights up: whether the loss turns NaN first or a fake-quant observer meets
    # the non-finite weights first, the stage fails with the same advice
    "qat: training diverges": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "qat", "--set", "qat.optimizer=sgd", "--set", "qat.lr=10000"],
        "the last resume checkpoint is kept - lower qat.lr (e.g. --set qat.lr=1000, a tenth) and rerun"),
}
EXIT_CODES = {"qat: accuracy budget exceeded": 1, "qat: training diverges": 1}
CHANGES_FILES = {"qat: accuracy budget exceeded", "qat: training diverges"}  # a failed run keeps its files


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, run_copy, tmp_path):
    setup, args, expected = CASES[name]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    setup(run_copy, scratch)
    before = file_bytes(run_copy)
    result = invoke(*args(run_copy, scratch))
    code = EXIT_CODES.get(name, 2)
    assert result.exit_code == code, f"{name}: exit {result.exit_code}, expected {code}\n{result.output}"
    assert expected in result.stderr, f"{name}: {result.stderr}"
    assert "Traceback" not in result.output
    error_lines = [line for line in result.stderr.splitlines() if line.lower().startswith("error")]
    assert len(error_lines) == 1, f"{name}: expected one error line, got {result.stderr}"
    if name not in CHANGES_FILES:
        assert file_bytes(run_copy) == before, f"{name}: files in the run directory changed"
