"""The bad-input table: every malformed input gets one clear line, exit code 2, no traceback, and leaves
every file already in the run directory byte-identical."""

import json

import onnx
import pytest
from safetensors.torch import save_file

from compress.checkpoint import read_weights
from compress.fileio import sha256_file
from conftest import file_bytes, invoke


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


# name: (setup(run, tmp) -> None, args(run, tmp) -> list, expected text in the error)
CASES = {
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
        lambda r, t: ["run", "-c", t / "c.yaml", "--run-dir", r], "distill.kd.temperature: must be > 0"),
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
    "checkpoint: another model": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--set", "model.teacher=light_cnn"],
        "holds a 'deep_cnn' model but the config asks for 'light_cnn'"),
    "checkpoint: wrong dtype": (
        lambda r, t: as_half_precision(r),
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--force"], "wrong dtype"),
    "checkpoint: input missing": (
        lambda r, t: (r / "teacher" / "model.safetensors").unlink(),
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--force"], "run the teacher stage first"),
    "distill: wrong layer name": (
        lambda r, t: None,
        lambda r, t: ["run", "--run-dir", r, "--stages", "distill", "--set", "distill.hint.student_layer=block7"],
        "the student has no layer 'block7'; available layers: stem"),
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
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, run_copy, tmp_path):
    setup, args, expected = CASES[name]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    setup(run_copy, scratch)
    before = file_bytes(run_copy)
    result = invoke(*args(run_copy, scratch))
    assert result.exit_code == 2, f"{name}: exit {result.exit_code}\n{result.output}"
    assert expected in result.stderr, f"{name}: {result.stderr}"
    assert "Traceback" not in result.output
    error_lines = [line for line in result.stderr.splitlines() if line.lower().startswith("error")]
    assert len(error_lines) == 1, f"{name}: expected one error line, got {result.stderr}"
    assert file_bytes(run_copy) == before, f"{name}: files in the run directory changed"
