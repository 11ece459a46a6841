"""The run's report (compress.run.report): rows no longer current marked, the precision each PyTorch row was
measured in, a damaged export report that blocks nothing, and the file to deploy marked."""

import json

import pytest

from compress.run.report import build_rows, figure
from compress.run.rundir import RunDir
from conftest import invoke
from stages import STAGES


def test_the_report_marks_rows_that_are_no_longer_current(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.lr=0.0002")
    assert result.exit_code == 0, result.output
    report = (run_copy / "report.md").read_text()
    assert "| int8 ONNX (onnxruntime) *(stale)* |" in report and "| fp32 ONNX (onnxruntime) *(stale)* |" in report
    assert "export is stale (qat/qat.safetensors changed since this stage ran)" in report
    # the command that refreshes it names this run directory: a bare `compress run` would start artifacts/default
    assert f"`compress run --run-dir {run_copy}` brings it up to date" in report
    teacher_row = next(line for line in report.splitlines() if line.startswith("| teacher"))
    assert teacher_row.endswith("| - | - |") is False  # the teacher is current; export's timing of it still holds
    rows = json.loads((run_copy / "report.json").read_text())["rows"]
    assert {r["id"]: r["current"] for r in rows}["qat"] is True

    result = invoke("run", "--run-dir", run_copy, "--stages", "teacher", "--set", "teacher.epochs=1")
    assert result.exit_code == 0, result.output
    report = (run_copy / "report.md").read_text()
    teacher_row = next(line for line in report.splitlines() if line.startswith("| teacher"))
    assert "stale" not in teacher_row and teacher_row.endswith("| - | - |"), teacher_row  # old latency dropped
    precision = json.loads((run_copy / "manifest.json").read_text())["stages"]["distill"]["metrics"]["precision"]
    how = "PyTorch fp32" if precision == "fp32" else f"PyTorch, evaluated in {precision}"  # bf16 where the CPU has it
    assert f"| student, distilled ({how}) *(stale)* |" in report


def test_a_pytorch_row_says_the_precision_its_accuracy_was_measured_in():
    """A PyTorch row names the precision its accuracy was measured in (bf16 autocast, not "fp32"), so a few tenths
    from the fp32 ONNX row of the same weights are not read as the export gaining or losing accuracy."""
    from compress.run.report import evaluated_in

    assert evaluated_in({"precision": "fp32"}) == evaluated_in({}) == "PyTorch fp32"
    assert evaluated_in({"precision": "bf16"}) == "PyTorch, evaluated in bf16"


def test_a_damaged_export_report_does_not_block_other_stages(run_copy):
    path = run_copy / "export" / "export.json"
    report = json.loads(path.read_text())
    del report["latency_ms"]
    path.write_text(json.dumps(report))
    result = invoke("run", "--run-dir", run_copy, "--stages", "teacher")
    assert result.exit_code == 0, result.output
    assert f"export: no rows - its files are damaged: {path}: latency_ms is missing; rerun" in (
        run_copy / "report.md").read_text()


def test_the_report_marks_the_file_to_deploy_and_labels_its_log_axes(finished_run):
    """The PNG rings the file to deploy and names it in the legend; each log axis carries several labelled ticks,
    not one; the teacher's row says its latency is its fp32 ONNX export's, whatever precision its accuracy was
    evaluated in."""
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


def test_the_latency_columns_are_labelled_with_the_batch_sizes_timed(finished_run):
    """The tiny run times batches 1 and 8 (export.latency_batch_sizes): report.md, `compress show` and the figure
    label the second latency column batch 8, not 64; report.json's rows say which batch their latency_b64_ms is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = json.loads((finished_run / "manifest.json").read_text())["stages"]["export"]["config"]["export"]
    assert max(timed["latency_batch_sizes"]) == 8
    report = (finished_run / "report.md").read_text()
    assert "| artifact | params | size | val acc | latency b1 | latency b8 |" in report
    rows = json.loads((finished_run / "report.json").read_text())["rows"]
    assert {r["latency_batch"] for r in rows if r["latency_b64_ms"] is not None} == {8}
    header = next(line for line in invoke("show", finished_run).stdout.splitlines() if "val acc" in line)
    assert header.split()[-2:] == ["b1", "b8"], header
    fig = figure(build_rows(RunDir(finished_run), STAGES)[0])
    try:
        assert fig.axes[1].get_xlabel().startswith("latency, batch 8,")
    finally:
        plt.close(fig)


def test_batch_1_alone_timed_gives_one_latency_column_not_two_alike():
    from compress.run.report import markdown_table, text_table

    rows = [{"artifact": "int8 ONNX (onnxruntime)", "params": 10, "size_bytes": 2000, "val_acc": 90.0,
             "latency_b1_ms": 0.1234, "latency_b64_ms": 0.1234, "latency_batch": 1}]
    table = markdown_table(rows).splitlines()
    assert table[0] == "| artifact | params | size | val acc | latency b1 |" and table[1].count("|") == 6
    assert table[2].endswith("| 0.123 ms |") and "0.12 ms" not in table[2]
    assert text_table(rows)[0].split()[-1] == "b1" and "0.12 ms" not in text_table(rows)[1]



@pytest.mark.parametrize("val_acc", [10**400, 1e308])
def test_a_figure_that_is_no_plausible_number_is_shown_as_not_available(run_copy, val_acc):
    """A hand-edited figure too large for a float (an integer of 400 digits) or a percentage of 1e308 is shown as
    not available with a note naming its file and key; `show` and `report` go on with the rest, and the PNG is
    drawn without it."""
    manifest = json.loads((run_copy / "manifest.json").read_text())
    manifest["stages"]["teacher"]["metrics"]["val_acc"] = val_acc
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    path = run_copy / "export" / "export.json"
    export = json.loads(path.read_text())
    export["size_bytes"]["int8"] = 10**400
    export["fp32"]["onnx_acc"] = 1e308
    path.write_text(json.dumps(export))

    shown = invoke("show", run_copy)
    assert shown.exit_code == 0, shown.output
    teacher = next(line for line in shown.stdout.splitlines() if line.strip().startswith("teacher ("))
    assert teacher.split(")")[-1].split()[0] == "-", teacher
    assert "the val_acc of the teacher (PyTorch" in shown.stdout and "in manifest.json (stage 'teacher') is damaged" \
        in shown.stdout
    assert "the size_bytes of the int8 ONNX (onnxruntime) row in export/export.json is damaged" in shown.stdout

    (run_copy / "report.png").unlink()
    reported = invoke("report", run_copy)
    assert reported.exit_code == 0, reported.output
    report = (run_copy / "report.md").read_text()
    assert "the val_acc of the fp32 ONNX (onnxruntime) row in export/export.json is damaged" in report
    int8 = next(line for line in report.splitlines() if line.startswith("| int8 ONNX (onnxruntime)"))
    assert int8.split("|")[3].strip() == "-" and int8.split("|")[4].strip().endswith("%"), int8  # the rest kept
    assert (run_copy / "report.png").stat().st_size > 0
    rows = json.loads((run_copy / "report.json").read_text())["rows"]
    assert {r["id"]: r["val_acc"] for r in rows}["teacher"] is None


def test_the_figure_skips_points_that_are_not_finite(finished_run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, _ = build_rows(RunDir(finished_run), STAGES)
    drawn = [r for r in rows if r["val_acc"] is not None and r["size_bytes"] is not None]
    drawn[0]["val_acc"], drawn[1]["size_bytes"] = float("inf"), float("nan")
    fig = figure(rows)
    try:
        fig.canvas.draw()
        names = [t.get_text() for t in fig.legends[0].get_texts()]
        assert not any(n.startswith(drawn[0]["artifact"]) for n in names)
        sizes = [x for c in fig.axes[0].collections for x, _ in c.get_offsets()]
        assert sizes and all(x == x and x < float("inf") for x in sizes), sizes
        assert len(fig.axes[0].collections) < len(drawn) + sum(bool(r.get("ship")) for r in drawn)
    finally:
        plt.close(fig)


def test_a_damaged_figure_the_export_notes_read_from_the_manifest_leaves_the_notes_out(run_copy):
    """The export stage's notes format figures of its manifest entry (not a hashed file): one of 400 digits there
    leaves those notes out with a sentence, never an OverflowError in show or report."""
    manifest = json.loads((run_copy / "manifest.json").read_text())
    manifest["stages"]["export"]["metrics"]["int8_onnx_acc"] = 10**400
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    for command in ("show", "report"):
        result = invoke(command, run_copy)
        assert result.exit_code == 0, result.output
        assert "export: its notes are left out - a figure in manifest.json is damaged" in result.stdout + \
            (run_copy / "report.md").read_text()


def test_report_md_escapes_control_characters_from_a_manifest_message_and_the_run_folders_name(run_copy, tmp_path):
    """report.md is read with `cat`: an ESC from a stage's message in manifest.json or from the run folder's name
    is written escaped, as the terminal's lines are."""
    import shutil

    run = tmp_path / "r\x1b]0;pwn\x07"
    shutil.copytree(run_copy, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["teacher"].update(status="failed", message="\x1b[2J boom")
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = invoke("report", run)
    assert result.exit_code == 0, result.output
    report = (run / "report.md").read_text()
    assert "\x1b" not in report and "\x07" not in report
    assert "r\\x1b]0;pwn\\x07" in report and "\\x1b[2J boom" in report
