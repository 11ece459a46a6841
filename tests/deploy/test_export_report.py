"""What the export stage leaves for people and programs: export.json in its typed schema (an earlier version's
still read, shown and left up to date), one latency measurement behind the verdict, the report's table and
`compress bench`, and a report and `compress show` that name the file to deploy."""

import ast
import dataclasses
import json
import typing

from compress.deploy import export_report
from compress.deploy.export_report import ExportReport
from compress.run.report import build_rows, figure
from compress.run.rundir import RunDir
from conftest import invoke
from stages import STAGES

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
    """Was: the same int8 file read 56.7 ms in the verdict (its own timing, the fastest run), 83.2 ms in the
    report's table (a median of shorter rounds) and 70.9 ms from `compress bench` (a third protocol). Now the
    verdict's figures are the table's cells, and bench times the same files by the same protocol, in the same
    cells, on the same input."""
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


def test_show_names_the_verdict_the_student_alone_and_the_ptq_file(finished_run):
    shown = invoke("show", finished_run)
    assert shown.exit_code == 0, shown.output
    export = json.loads((finished_run / "export" / "export.json").read_text())
    verdict = export["verdict"]
    lines = shown.stdout.splitlines()
    assert lines[-1] == f"deploy export/{verdict['file']}: {verdict['why']}"
    alone = next(line for line in lines if "student alone, no teacher" in line)
    baseline = json.loads((finished_run / "manifest.json").read_text())["stages"]["distill"]["metrics"]
    assert f"{baseline['baseline_val_acc']:.2f}%" in alone
    ptq = next(line for line in lines if "post-training quantized" in line)
    assert f"{export['ptq']['onnx_acc']:.2f}%" in ptq
    deployed = [line for line in lines if line.strip().split("  ")[0].endswith(" - deploy")]
    assert len(deployed) == 1 and ("int8 ONNX (" in deployed[0] or "fp32 ONNX" in deployed[0])


def test_the_report_marks_the_file_to_deploy_and_labels_its_log_axes(finished_run):
    """The PNG rings the file to deploy and names it in the legend; each log axis carries several labelled ticks
    (was: one - '100' and '10' - per axis); the teacher's row says its latency is its fp32 ONNX export's (was:
    'evaluated in bf16' beside that latency, without a word)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, _ = build_rows(RunDir(finished_run), STAGES)
    verdict = json.loads((finished_run / "export" / "export.json").read_text())["verdict"]
    assert [r["file"] for r in rows if r.get("ship")] == [f"export/{verdict['file']}"]
    teacher = next(r for r in rows if r["id"] == "teacher")
    assert teacher["artifact"].endswith("; latency: its fp32 ONNX export in onnxruntime)")
    fig = figure(rows)
    try:
        for ax in fig.axes:
            low, high = ax.get_xlim()
            labelled = [t for t in ax.xaxis.get_major_ticks() if low <= t.get_loc() <= high]
            assert len(labelled) >= 3, [t.get_loc() for t in labelled]
            fig.canvas.draw()
            assert all(t.label1.get_text() for t in labelled)
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert [t for t in legend if t.endswith(" - the file to deploy")] == [
            next(r["artifact"] for r in rows if r.get("ship")) + " - the file to deploy"]
    finally:
        plt.close(fig)
    assert "**- deploy**" in (finished_run / "report.md").read_text()
