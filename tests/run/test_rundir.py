"""The run directory, its manifest and lock (compress.run.rundir): a folder that is not a run left alone, a
held lock named and waited out, a stale one taken over, a pipe or a folder where a file goes refused, and a
manifest that lies refused in one sentence - each found by trying the tool as a hostile but realistic user
(issue 9). The one-line errors themselves are in the bad-input table."""

import json
import os
import signal
import socket
import subprocess

import pytest

from compress.run.rundir import RunDir, RunLock
from conftest import HANG, compress_subprocess, file_bytes, invoke

pytestmark = pytest.mark.e2e


def test_a_folder_that_is_not_a_run_is_refused_and_left_alone(tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "report.md").write_text("my notes")
    before = file_bytes(foreign)
    result = invoke("run", "--run-dir", foreign, "--set", "data.name=digits")
    assert result.exit_code == 2
    assert "is not empty and is not a compress run" in result.stderr
    assert file_bytes(foreign) == before


def test_another_programs_folder_with_a_manifest_and_a_config_is_named_as_such(tmp_path):
    """A web app's folder holds manifest.json and config.yaml too: it is not read as a run (its config's keys
    listed as unknown), nor told to move its manifest away (which leads to the next refusal); nothing changes."""
    foreign = tmp_path / "webapp"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"name": "app", "icons": []}')
    (foreign / "config.yaml").write_text("server: {port: 80}\n")
    before = file_bytes(foreign)
    for args in ([], ["-c", "default"], ["--dry-run"]):
        result = invoke("run", "--run-dir", foreign, *args)
        assert result.exit_code == 2, result.output
        assert (f"'{foreign}' is not a compress run directory (its manifest.json is another program's); choose an "
                "empty or new folder with --run-dir") in result.stderr and "server" not in result.output
    assert file_bytes(foreign) == before


def test_a_folder_in_place_of_the_lock_file_is_named_by_report_too(run_copy):
    (run_copy / ".lock").unlink(missing_ok=True)
    (run_copy / ".lock").mkdir()
    result = invoke("report", run_copy)
    assert result.exit_code == 2
    assert f"run directory '{run_copy}' has a folder where its file .lock goes; move the folder away" in result.stderr


@pytest.mark.skipif(os.name != "posix", reason="file names as bytes")
def test_a_run_directory_named_in_bytes_that_are_not_utf8_is_refused_before_anything_is_written(tmp_path):
    """TensorBoard's writer (and JSON consumers of the manifest) refuse such a path: the teacher trained and then
    failed with 'unexpected UnicodeEncodeError'; now one sentence, nothing written. A UTF-8 name is fine."""
    bad = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"r\xff"))
    result = compress_subprocess("run", "--run-dir", bad, "--set", "data.name=digits", "--stages", "teacher")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "has a name that is not UTF-8 text, which the libraries writing into it refuse; choose a UTF-8 name " \
           "with --run-dir" in result.stderr
    assert os.listdir(tmp_path) == []
    planned = compress_subprocess("run", "--run-dir", bad, "--set", "data.name=digits", "--dry-run")
    assert planned.returncode == 2 and "has a name that is not UTF-8 text" in planned.stderr  # as the run would
    assert os.listdir(tmp_path) == []
    RunDir(str(tmp_path / "café")).check_usable()


def test_a_held_lock_names_its_holder_and_nothing_is_written(run_copy):
    """While another run holds the lock with qat running, `--stages export` names that run rather than ask for
    qat first, `show` calls the stage running now, --dry-run mentions it, and nothing is written."""
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
    assert "qat stage first" not in plan_export.output  # the held lock is the one reason given
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
    os.kill(first.pid, signal.SIGSTOP)  # held while the second starts, however slowly this machine imports torch
    try:
        second = subprocess.run(args, capture_output=True, text=True, timeout=300)
    finally:
        os.kill(first.pid, signal.SIGCONT)
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


def test_a_manifest_of_deeply_nested_brackets_is_one_clear_sentence(run_copy):
    """A manifest of deeply nested brackets is one sentence from `compress show`, not an unexpected
    RecursionError."""
    (run_copy / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    result = invoke("show", run_copy)
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: manifest '{run_copy / 'manifest.json'}' is not valid JSON "
                                     "(RecursionError); restore it, or move it away and rerun the stage that wrote it")


@pytest.mark.parametrize("name", [".lock", "log.txt", "config.yaml"])
def test_a_pipe_in_the_run_directory_is_refused_never_waited_on(run_copy, name):
    """A FIFO as <run>/.lock, log.txt or config.yaml is refused, never waited on, by `compress show` and the run."""
    (run_copy / name).unlink(missing_ok=True)
    os.mkfifo(run_copy / name)
    before = file_bytes(run_copy)
    show = compress_subprocess("show", run_copy, timeout=HANG)
    assert show.returncode in (0, 2), show.stderr  # shown, or (config.yaml: read by show) refused in a sentence
    proc = compress_subprocess("run", "--run-dir", run_copy, "--stages", "export", "--force", timeout=HANG)
    assert proc.returncode == 2, proc.stderr
    assert f"run directory '{run_copy}' contains a pipe, {name}, where compress keeps only files and folders; " \
        "remove it and rerun" in proc.stderr
    assert file_bytes(run_copy) == before


@pytest.mark.parametrize("rel", ["log.txt", "export/export.json", "teacher/metrics.json",
                                 "distill/teacher_outputs/store.json"])
def test_a_folder_where_a_file_goes_is_refused_before_the_work(run_copy, rel):
    """A folder where a run file or a stage's output goes is refused in a sentence before the stage does its work,
    not with an IsADirectoryError after it."""
    (run_copy / rel).unlink(missing_ok=True)  # the tiny run keeps no teacher-output store
    os.makedirs(run_copy / rel)
    before = file_bytes(run_copy)
    stage = rel.split("/")[0] if "/" in rel else "export"
    proc = compress_subprocess("run", "--run-dir", run_copy, "--stages", stage, "--force", timeout=HANG)
    assert proc.returncode == 2, proc.stderr
    assert f"has a folder where its file {rel} goes; move the folder away and rerun" in proc.stderr
    assert file_bytes(run_copy) == before


@pytest.mark.parametrize("value", ["high", [97.2], True])
def test_a_manifest_metric_of_the_wrong_type_is_one_sentence(run_copy, value):
    """A manifest metric of the wrong type is one sentence from show and run, not an unexpected ValueError."""
    manifest = json.loads((run_copy / "manifest.json").read_text())
    manifest["stages"]["distill"]["metrics"]["val_acc"] = value
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    before = file_bytes(run_copy)
    for args in (["show", run_copy], ["run", "--run-dir", run_copy, "--stages", "export"]):
        proc = compress_subprocess(*args, timeout=HANG)
        assert proc.returncode == 2, proc.stderr
        assert f"manifest '{run_copy / 'manifest.json'}' is not a compress manifest (stage 'distill' has a metric " \
            "\"val_acc\" that is not a number" in proc.stderr
    assert file_bytes(run_copy) == before
