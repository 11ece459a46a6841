"""Hostile input on the deployment side: an export.json or ONNX file edited to point outside the run, to lack
what a deployment reads, or to contradict itself. Each is refused with one sentence that names the file or key
and what to do, exit 2, no traceback, and every file in the run directory left byte-identical."""

import json
import shutil

import onnx
import pytest

from conftest import file_bytes, invoke


def edit_export_json(run, fn):
    path = run / "export" / "export.json"
    data = json.loads(path.read_text())
    data = fn(data)
    path.write_text(json.dumps(data))


def set_verdict(**changes):
    def edit(data):
        data["verdict"].update(changes)
        return data
    return edit


def without_verdict_key(key):
    def edit(data):
        del data["verdict"][key]
        return data
    return edit


def evil_file_outside(run, tmp):
    """A working ONNX file outside the run, which a verdict of '../../elsewhere/evil.onnx' reaches: the old code
    loaded and ran it (exit 0)."""
    (tmp / "elsewhere").mkdir(exist_ok=True)
    shutil.copy(run / "export" / "model.fp32.onnx", tmp / "elsewhere" / "evil.onnx")
    relative = "../../elsewhere/evil.onnx"
    assert (run / "export" / relative).resolve() == (tmp / "elsewhere" / "evil.onnx").resolve()
    edit_export_json(run, set_verdict(file=relative))


def link_to_outside(run, tmp):
    """export/ holds a link, named like a model file, to a file outside the run."""
    (tmp / "elsewhere").mkdir(exist_ok=True)
    shutil.copy(run / "export" / "model.fp32.onnx", tmp / "elsewhere" / "evil.onnx")
    (run / "export" / "model.link.onnx").symlink_to(tmp / "elsewhere" / "evil.onnx")
    edit_export_json(run, set_verdict(file="model.link.onnx"))


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


def image(tmp):
    from PIL import Image

    Image.new("L", (8, 8), 128).save(tmp / "img.png")
    return tmp / "img.png"


EXPORT_JSON = "export.json"
CASES = {
    # deployment files resolve strictly inside the run's export/ folder
    "verdict file: a path out of the run": (
        evil_file_outside, "predict",
        "export.json: verdict.file '../../elsewhere/evil.onnx' is not a file name inside"),
    "verdict file: an absolute path": (
        lambda r, t: edit_export_json(r, set_verdict(file="/etc/passwd")), "predict",
        "export.json: verdict.file '/etc/passwd' is not a file name inside"),
    "verdict file: a link out of export/": (
        link_to_outside, "predict",
        "export.json: verdict.file 'model.link.onnx' is a link to"),
    "bench: a file the verdict weighed, out of the run": (
        lambda r, t: edit_export_json(r, lambda d: {**d, "verdict": {**d["verdict"], "candidates": [
            d["verdict"]["candidates"][0], {**d["verdict"]["candidates"][1], "file": "../../../etc/passwd"}]}}),
        "bench", "export.json: verdict.candidates[1].file '../../../etc/passwd' is not a file name inside"),
    "bench: the int8 file weighed, out of an earlier version's run": (
        lambda r, t: edit_export_json(r, lambda d: {**d, "verdict": {k: v for k, v in d["verdict"].items()
                                                                     if k != "candidates"},
                                                    "speed": {**d["speed"], "int8_file": "../../../etc/passwd"}}),
        "bench", "export.json: speed.int8_file '../../../etc/passwd' is not a file name inside"),
    # a verdict that is not one
    "verdict: no file": (
        lambda r, t: edit_export_json(r, without_verdict_key("file")), "predict",
        "export.json: verdict.file is missing"),
    "verdict: no why": (
        lambda r, t: edit_export_json(r, without_verdict_key("why")), "predict",
        "export.json: verdict.why is missing"),
    "verdict: file of the wrong type": (
        lambda r, t: edit_export_json(r, set_verdict(file=5)), "predict",
        "export.json: verdict.file must be text, got 5"),
    "verdict: a string, not a mapping": (
        lambda r, t: edit_export_json(r, lambda d: {**d, "verdict": "model.int8.onnx"}), "predict",
        "export.json: verdict must be a mapping, got 'model.int8.onnx'"),
    "export.json: a list": (
        lambda r, t: edit_export_json(r, lambda d: [d]), "predict",
        "export.json is not an export report (a JSON list, not a mapping)"),
    "export.json: not JSON": (
        lambda r, t: (r / "export" / "export.json").write_text("{not json"), "predict",
        "is not valid JSON"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_export_json_is_refused_in_one_sentence_and_nothing_changes(run_copy, tmp_path, case):
    setup, command, message = CASES[case]
    setup(run_copy, tmp_path)
    before = file_bytes(run_copy)
    args = (["predict", run_copy, image(tmp_path)] if command == "predict" else
            ["bench", run_copy, "--batch", "1", "--threads", "1", "--repeats", "3"])
    result = invoke(*args)
    assert result.exit_code == 2, (case, result.output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and message in errors[0], (case, result.stderr)
    assert "Traceback" not in result.output and "unexpected" not in result.output
    assert str(run_copy / "export" / EXPORT_JSON) in errors[0] or "not valid JSON" in errors[0], errors
    assert "rerun" in errors[0] or "restore" in errors[0], errors  # and says what to do
    assert file_bytes(run_copy) == before


def test_show_and_report_of_a_run_with_a_hostile_export_json_say_so_and_go_on(run_copy):
    """show and report are for looking: they name the damage and still show the other stages."""
    edit_export_json(run_copy, set_verdict(file="/etc/passwd"))
    shown = invoke("show", run_copy)
    assert shown.exit_code == 0, shown.output
    assert "teacher  complete" in shown.stdout and "/etc/passwd' is not a file name inside" in shown.stdout
    reported = invoke("report", run_copy)
    assert reported.exit_code == 0, reported.output
    assert "Deploy export//etc/passwd" not in (run_copy / "report.md").read_text()


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
    """Was: predict cropped 16x16 pixels and onnxruntime failed on them ('unexpected ...', a traceback's last
    line); a shorter side below the crop cannot be centre-cropped at all."""
    onnx_with_resize(finished_run, tmp_path, rule, input_shape)
    for args in (["predict", tmp_path / "resized.onnx", tmp_path / "img.png"],
                 ["eval", tmp_path / "resized.onnx", tmp_path]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert message in result.stderr and f"'{tmp_path / 'resized.onnx'}'" in result.stderr, result.stderr
        assert "re-export the model" in result.stderr and "Traceback" not in result.output
