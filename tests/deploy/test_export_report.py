"""export.json as people and programs read it (compress.deploy.export_report): its typed schema (an earlier
version's still read, shown and left up to date) and one latency measurement behind the verdict, the table and
`compress bench`; an export.json edited to point outside the run, to lack what a deployment reads, or to
contradict itself is refused in one sentence that names the file or key and what to do, exit 2, no traceback,
every file in the run directory left byte-identical."""

import ast
import dataclasses
import json
import shutil
import typing

import pytest

from compress.deploy import export_report
from compress.deploy.export_report import ExportReport
from conftest import file_bytes, invoke

pytestmark = pytest.mark.e2e

# the keys export.json had before its schema was written down (the previous version's file, as `compress run`
# left it in a finished run directory): a run directory it finished must still be read, shown and skipped
EARLIER_KEYS = ("opset", "params", "files", "size_bytes", "size_ratio_int8_fp32", "fp32", "int8", "int8_kernels",
                "int8_optimized_ops", "ptq", "cpus_busy_while_timing", "runtimes", "latency_ms", "speed",
                "float_layers", "mixed_precision", "teacher_file", "checks", "verdict")
EARLIER_CELL = ("batch", "threads", "ms", "images_per_s")
EARLIER_VERDICT = ("deploy", "file", "runtime", "int8_faster", "why")


def cell(cells, batch, threads):
    return next(c for c in cells if (c["batch"], c["threads"]) == (batch, threads))


def test_export_json_is_exactly_its_schema(finished_run):
    """Every key export.json holds is a field of ExportReport (or of the dataclasses inside it), and reading it
    back gives the same JSON: the dataclasses are the schema, documented field by field."""
    data = json.loads((finished_run / "export" / "export.json").read_text())
    report = export_report.read(finished_run)
    assert dataclasses.asdict(report) == data
    assert set(data) == {f.name for f in dataclasses.fields(ExportReport)}
    classes = {c.__name__ for c in vars(export_report).values() if dataclasses.is_dataclass(c)}
    for node in ast.parse(open(export_report.__file__).read()).body:  # each field with its docstring under it
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for field, after in zip(node.body, node.body[1:] + [None]):
                if isinstance(field, ast.AnnAssign):
                    assert isinstance(after, ast.Expr) and isinstance(after.value.value, str), \
                        f"{node.name}.{field.target.id} has no docstring"
    assert typing.get_type_hints(ExportReport)["verdict"] is export_report.Verdict


def test_the_verdict_the_table_and_bench_give_one_figure_per_file(finished_run):
    """One file has one latency: the verdict's figures are the report table's cells, and `compress bench` times the
    same files by the same protocol, in the same cells, on the same input - three protocols would give one int8
    file three figures (56.7, 83.2 and 70.9 ms were seen)."""
    export = json.loads((finished_run / "export" / "export.json").read_text())
    speed, tables, verdict = export["speed"], export["latency_ms"], export["verdict"]
    batch = max(c["batch"] for c in tables["fp32"])
    threads = max(c["threads"] for c in tables["fp32"])
    assert (speed["batch"], speed["threads"]) == (batch, threads)
    weighed = next(c["kind"] for c in verdict["candidates"] if c["file"] == speed["int8_file"])
    assert speed["fp32_ms"] == cell(tables["fp32"], batch, threads)["ms"]
    assert speed["int8_ms"] == cell(tables[weighed], batch, threads)["ms"]
    assert {c["kind"]: c["ms"] for c in verdict["candidates"]} == {
        k: cell(tables[k], batch, threads)["ms"] for k in ("fp32", "int8", "ptq")}
    rows = json.loads((finished_run / "report.json").read_text())["rows"]
    for kind in ("fp32", "int8", "ptq"):
        row = next(r for r in rows if r["file"] == f"export/model.{kind}.onnx")
        assert row["latency_b64_ms"] == cell(tables[kind], batch, threads)["ms"]
    bench = invoke("bench", finished_run, "--json")
    assert bench.exit_code == 0, bench.output
    timed = json.loads(bench.stdout)
    assert timed["protocol"] == export["latency_protocol"]
    assert [f["path"] for f in timed["files"]] == [str(finished_run / "export" / f"model.{k}.onnx")
                                                   for k in ("fp32", "int8", "ptq")]
    assert [(c["batch"], c["threads"]) for c in timed["files"][0]["cells"]] == [
        (c["batch"], c["threads"]) for c in tables["fp32"]]


def test_a_run_an_earlier_version_finished_is_still_read_shown_reported_and_up_to_date(run_copy):
    """export.json as the previous version wrote it (no candidates in the verdict, no per-round figures, no
    pairs against fp32): predict follows its verdict, bench times its pair, show and report show it, and a plain
    run skips export - what decides reruns did not change."""
    path = run_copy / "export" / "export.json"
    data = json.loads(path.read_text())
    earlier = {k: v for k, v in data.items() if k in EARLIER_KEYS}
    earlier["verdict"] = {k: v for k, v in data["verdict"].items() if k in EARLIER_VERDICT}
    earlier["latency_ms"] = {k: [{f: c[f] for f in EARLIER_CELL} for c in cells]
                             for k, cells in data["latency_ms"].items()}
    path.write_text(json.dumps(earlier))
    manifest = json.loads((run_copy / "manifest.json").read_text())  # as the earlier export recorded it
    from compress.fileio import sha256_file

    manifest["stages"]["export"]["outputs"]["export/export.json"] = sha256_file(path)
    for key in ("verdict_cell",):
        manifest["stages"]["export"]["metrics"].pop(key)
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    shown = invoke("show", run_copy)
    assert shown.exit_code == 0, shown.output
    assert f"deploy export/{data['verdict']['file']}: {data['verdict']['why']}" in shown.stdout
    assert "student alone, no teacher" in shown.stdout and "post-training quantized" in shown.stdout
    assert invoke("report", run_copy).exit_code == 0
    report = (run_copy / "report.md").read_text()
    assert f"Deploy export/{data['verdict']['file']}:" in report and "The verdict reads the latency table" not in report
    bench = invoke("bench", run_copy, "--batch", "2", "--threads", "1", "--json")
    assert bench.exit_code == 0, bench.output
    assert [f["path"] for f in json.loads(bench.stdout)["files"]] == [
        str(run_copy / "export" / name) for name in ("model.fp32.onnx", data["speed"]["int8_file"])]
    planned = invoke("run", "--run-dir", run_copy, "--dry-run")
    assert "export   skip    same config and inputs" in planned.output, planned.output


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
    """A working ONNX file outside the run, which a verdict of '../../elsewhere/evil.onnx' reaches: a verdict may
    name only files inside export/, however the file it reaches would load."""
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
    "verdict file: a file of export/ that is no model": (
        lambda r, t: edit_export_json(r, set_verdict(file="export.json")), "predict",
        "export.json: verdict.file 'export.json' is not an ONNX file (.onnx); rerun"),
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
