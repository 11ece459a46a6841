"""`compress show` (compress.cli.inspect_cmds): files modified by hand, and what the export stage decided."""

import json
import os

import pytest
import yaml

from conftest import invoke

pytestmark = pytest.mark.e2e


def test_show_reports_modified_files(run_copy):
    path = run_copy / "teacher" / "metrics.json"
    path.write_text(path.read_text() + " ")
    shown = invoke("show", run_copy).output
    assert "modified   teacher/metrics.json" in shown and "ok         teacher/model.safetensors" in shown
    path.unlink()
    os.mkfifo(path)  # a pipe in a file's place is named as what it is (reading it would block)
    assert "not a file teacher/metrics.json" in invoke("show", run_copy).output
    (run_copy / "manifest.json").unlink()
    (run_copy / "manifest.json").mkdir()
    refused = invoke("show", run_copy)
    assert refused.exit_code == 2 and f"'{run_copy / 'manifest.json'}' is not a regular file (a folder, pipe, device " \
        "or link); replace it with the run's manifest" in refused.stderr


def test_show_names_the_stages_an_edited_config_yaml_would_run_again(run_copy):
    """A finished run whose config.yaml was edited by hand: its stages are still complete (their files are as
    written), and show says which the next run repeats and for which keys - not 'complete' alone."""
    assert "config.yaml changed" not in invoke("show", run_copy).output
    config = run_copy / "config.yaml"
    edited = yaml.safe_load(config.read_text())
    edited["qat"]["lr"] = 0.000123
    config.write_text(yaml.safe_dump(edited))
    shown = invoke("show", run_copy)
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    said = [lines[i - 1].split()[0] for i, line in enumerate(lines) if "config.yaml changed since it ran" in line]
    assert said == ["qat"], shown.stdout
    assert f"(qat.lr): the next `compress run --run-dir {run_copy}` runs it again" in shown.stdout
    config.write_text("teacher: [")  # unreadable: show still shows (compress run says what is wrong)
    assert invoke("show", run_copy).exit_code == 0


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
    row = {"model.int8.onnx": "int8 ONNX (", "model.ptq.onnx": "int8 ONNX, post-training quantized",
           "model.fp32.onnx": "fp32 ONNX"}[verdict["file"]]  # whichever the verdict named (timings decide)
    assert len(deployed) == 1 and deployed[0].strip().startswith(row), deployed


def test_show_qualifies_the_verdict_of_an_export_json_changed_by_hand(run_copy):
    """export.json edited after export wrote it (another file named, another reason): show marks the file modified and
    says the deploy line comes from that changed file."""
    export = run_copy / "export"
    (export / "other.onnx").write_bytes((export / "model.fp32.onnx").read_bytes())
    report = json.loads((export / "export.json").read_text())
    report["verdict"].update(file="other.onnx", why="all good")
    (export / "export.json").write_text(json.dumps(report))
    shown = invoke("show", run_copy)
    assert shown.exit_code == 0, shown.output
    assert "modified   export/export.json" in shown.stdout
    assert shown.stdout.splitlines()[-1] == ("deploy (from an export.json changed since export wrote it) "
                                             "export/other.onnx: all good")


@pytest.mark.parametrize("command", ["show", "report"])
def test_without_a_run_directory_the_example_is_the_command_itself(command, tmp_path, monkeypatch):
    """With no run under artifacts/ here, the example names no run that is not there (a --run-dir run is
    anywhere): the command itself, with the folder to pass."""
    monkeypatch.chdir(tmp_path)  # no artifacts/default here
    result = invoke(command)
    assert result.exit_code == 2
    assert (f"no run in artifacts/ here; pass the folder a run wrote (its --run-dir): compress {command} RUN_DIR"
            in result.stderr) and "artifacts/photos" not in result.stderr


def test_a_run_named_as_run_names_it_is_found_under_artifacts(finished_run, tmp_path, monkeypatch):
    """`compress run -c photos` (or --name photos) writes artifacts/photos: show, predict, bench and stages given
    'photos', or nothing while artifacts/default is absent, point at it instead of only saying it is not there."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(finished_run, tmp_path / "artifacts" / "photos")
    shown = invoke("show")
    assert shown.exit_code == 2 and "e.g. compress show artifacts/photos (runs here, the latest first: " \
        "artifacts/photos)" in shown.stderr, shown.stderr
    for args in (["show", "photos"], ["predict", "photos", "x.png"], ["bench", "photos"],
                 ["stages", "--run-dir", "photos"]):
        result = invoke(*args)
        assert result.exit_code == 2 and "did you mean artifacts/photos?" in result.stderr, (args, result.output)


def test_show_without_a_run_suggests_the_latest_run_and_counts_those_it_does_not_list(finished_run, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    for i in range(7):  # a manifest is what makes a folder a run; the latest first, whatever the names
        (tmp_path / "artifacts" / f"run{i}").mkdir(parents=True)
        manifest = tmp_path / "artifacts" / f"run{i}" / "manifest.json"
        manifest.write_bytes((finished_run / "manifest.json").read_bytes())
        os.utime(manifest, (1_000_000 + i, 1_000_000 + i))
    shown = invoke("show")
    assert shown.exit_code == 2, shown.output
    assert "e.g. compress show artifacts/run6 (runs here, the latest first: artifacts/run6, artifacts/run5, " \
           "artifacts/run4, artifacts/run3, artifacts/run2 and 2 more)" in shown.stderr, shown.stderr


def test_show_carries_the_exports_warning_that_the_file_to_deploy_is_hardly_better_than_chance(run_copy):
    import json

    assert "warning:" not in invoke("show", run_copy).output
    manifest = json.loads((run_copy / "manifest.json").read_text())
    said = "the file to deploy, model.int8.onnx, scores 11.00% on the validation images, hardly better than chance"
    manifest["stages"]["export"]["metrics"]["near_chance"] = said  # as export records it for such a file
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    shown = invoke("show", run_copy)
    assert shown.exit_code == 0, shown.output
    assert f"warning: {said}" in shown.output
