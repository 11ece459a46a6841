"""A run directory nothing can corrupt: each case found by trying the tool as a hostile but realistic user
(issue 9), replayed with the same inputs. The one-line errors themselves are in the bad-input table."""

import json
import os
import signal
import socket
import subprocess

import numpy as np
import onnx
import pytest
import yaml
from PIL import Image

from compress.data.datasets import load_data
from compress.fileio import dumps
from compress.run.config import load_config
from compress.run.rundir import RunDir, RunLock
from conftest import file_bytes, invoke


def test_an_override_for_a_stage_that_does_not_run_is_not_saved(run_copy):
    before = yaml.safe_load((run_copy / "config.yaml").read_text())
    result = invoke("run", "--run-dir", run_copy, "--stages", "export", "--set", "teacher.epochs=1")
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert saved["teacher"]["epochs"] == before["teacher"]["epochs"] == 2
    again = invoke("run", "--run-dir", run_copy, "--stages", "teacher")
    assert again.exit_code == 0 and "teacher: up to date, skipped" in again.stderr


def test_a_stage_that_runs_saves_its_own_keys_only(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.lr=0.0002",
                    "--set", "distill.epochs=9")
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert saved["qat"]["lr"] == 0.0002 and saved["distill"]["epochs"] == 2


def test_a_folder_that_is_not_a_run_is_refused_and_left_alone(tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "report.md").write_text("my notes")
    before = file_bytes(foreign)
    result = invoke("run", "--run-dir", foreign, "--set", "data.name=digits")
    assert result.exit_code == 2
    assert "is not empty and is not a compress run" in result.stderr
    assert file_bytes(foreign) == before


def test_a_held_lock_names_its_holder_and_nothing_is_written(run_copy):
    """Also (fresh-user pass): while another run had qat running, `--stages export` said "run the qat stage first:
    its last run did not finish", `show` called the running stage interrupted, and --dry-run did not mention it."""
    manifest = json.loads((run_copy / "manifest.json").read_text())
    manifest["stages"]["qat"]["status"] = "running"  # what the other run's manifest says while qat trains
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    before = file_bytes(run_copy)
    with RunLock(RunDir(run_copy)):
        result = invoke("run", "--run-dir", run_copy, "--stages", "export", "--force")
        report = invoke("report", run_copy)
        show = invoke("show", run_copy)
        plan = invoke("run", "--run-dir", run_copy, "--dry-run")
        plan_export = invoke("run", "--run-dir", run_copy, "--dry-run", "--stages", "export")
    holder = f"pid {os.getpid()} on host {socket.gethostname()}"
    assert result.exit_code == 2 and report.exit_code == 2
    assert f"another compress run ({holder}) is using" in result.stderr and "qat stage first" not in result.stderr
    assert f"(another compress run is using it now: {holder})" in show.output
    assert f"qat      running now ({holder}, since" in show.output
    assert plan.exit_code == 0 and f"note: another compress run ({holder}) is using {run_copy} now" in plan.output
    assert plan_export.exit_code == 2 and f"another compress run ({holder}) is using" in plan_export.output
    assert "qat stage first" not in plan_export.output  # the review: the dry run still said so
    after = file_bytes(run_copy)
    assert after == before


def test_a_run_directory_held_by_another_run_is_refused_and_left_alone(run_copy):
    """The lock is a real flock: while this test holds it (as a running `compress run` would), a real
    `compress run` on the folder exits 2 naming the holder and changes nothing; once released, it runs."""
    exe = os.path.join(os.path.dirname(os.sys.executable), "compress")
    args = [exe, "run", "--run-dir", str(run_copy), "--stages", "export", "--force"]
    lock = RunLock(RunDir(run_copy)).acquire()
    try:
        before = file_bytes(run_copy)
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert f"another compress run (pid {os.getpid()} on host {socket.gethostname()}) is using" in proc.stderr
        assert file_bytes(run_copy) == before
    finally:
        lock.release()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_two_runs_at_once_one_waits_out(run_copy):
    """Two real `compress run` processes on one folder, the second started while the first holds the lock: the
    second is refused (exit 2) and the first completes."""
    import time

    exe = os.path.join(os.path.dirname(os.sys.executable), "compress")
    args = [exe, "run", "--run-dir", str(run_copy), "--stages", "export", "--force"]
    first = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not _held_by(run_copy, first.pid) and time.time() < deadline and first.poll() is None:
        time.sleep(0.01)
    assert _held_by(run_copy, first.pid), "the first run never took the lock"
    second = subprocess.run(args, capture_output=True, text=True, timeout=300)
    out = first.communicate(timeout=300)[1]
    assert (first.returncode, second.returncode) == (0, 2), (out, second.stderr)
    assert f"another compress run (pid {first.pid}" in second.stderr
    assert json.loads((run_copy / "manifest.json").read_text())["stages"]["export"]["status"] == "complete"


def _held_by(run, pid):
    try:
        return json.loads((run / ".lock").read_text() or "null")["pid"] == pid
    except (OSError, ValueError, TypeError, KeyError):
        return False


def test_a_stale_lock_of_a_dead_process_is_taken_over(run_copy):
    (run_copy / ".lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname()}))
    result = invoke("run", "--run-dir", run_copy)
    assert result.exit_code == 0, result.output
    assert not (run_copy / ".lock").exists()


def test_json_files_are_strict():
    assert dumps({"a": float("nan"), "b": [float("inf"), 1.5]}) == '{"a": null, "b": [null, 1.5]}'


def test_ctrl_c_during_export_stops_it_with_exit_130(run_copy):
    exe = os.path.join(os.path.dirname(os.sys.executable), "compress")
    proc = subprocess.Popen([exe, "run", "--run-dir", str(run_copy), "--stages", "export", "--force",
                             "--set", "export.latency_repeats=200"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "export: running" in line:
            proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    output = "".join(lines)
    assert proc.returncode == 130, output
    assert "interrupted" in output and "rerun the same command" in output and "Traceback" not in output
    status = json.loads((run_copy / "manifest.json").read_text())["stages"]["export"]["status"]
    assert status in ("interrupted", "complete")
    for name in ("model.fp32.onnx", "model.int8.onnx"):  # atomic: a file is whole or absent
        path = run_copy / "export" / name
        if path.exists():
            onnx.checker.check_model(onnx.load(path))


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


def test_the_report_marks_rows_that_are_no_longer_current(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.lr=0.0002")
    assert result.exit_code == 0, result.output
    report = (run_copy / "report.md").read_text()
    assert "| int8 ONNX (onnxruntime) *(stale)* |" in report and "| fp32 ONNX (onnxruntime) *(stale)* |" in report
    assert "export is stale (qat/qat.safetensors changed since this stage ran)" in report
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
    """Was: "(PyTorch fp32)" on an accuracy measured under bf16 autocast, a few tenths from the fp32 ONNX row of
    the same weights (the fresh-user pass read that as the export gaining or losing accuracy)."""
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


def test_weights_blown_up_by_a_step_fail_the_stage_with_advice_not_an_exception():
    """A huge learning rate can leave weights non-finite after an update whose loss was still finite; the next
    forward of a QAT model then fails inside a fake-quant observer (no zero point fits a NaN range) before any
    loss exists. That is divergence, and the stage says so in one line."""
    import torch
    import torch.nn.functional as F

    from compress.data.imageset import Batch
    from compress.errors import StageFailed
    from compress.models.registry import build_model
    from compress.quant import fx as quant
    from compress.training.loop import Session, train_one_epoch
    from compress.training.schedule import Schedule

    torch.manual_seed(0)
    example = torch.randn(4, 1, 8, 8)
    prepared = quant.prepare(build_model("compact_cnn", (1, 8, 8), 10), example)
    with torch.no_grad():
        next(p for p in prepared.parameters() if p.dim() == 4)[0, 0, 0, 0] = float("nan")
    batches = [Batch(example, torch.arange(4), torch.arange(4), torch.full((4,), -1), torch.arange(4), torch.ones(4))]
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.1)
    with pytest.raises(StageFailed, match="qat: the weights became non-finite at epoch 1, step 1; .* lower qat.lr"):
        train_one_epoch(prepared, lambda b, step: (F.cross_entropy(prepared(b.x), b.y), {}), optimizer, batches,
                        Schedule("constant", 0.1, 1, 1), 0, Session(name="qat"))
