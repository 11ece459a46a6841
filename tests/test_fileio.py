"""Files written and read safely (compress.fileio): atomic writes, strict JSON, a folder where a file goes, a full
or read-only file system (where this machine lets a test mount one) in one sentence, and names escaped before
they reach the terminal or the log."""

import json
import os
import subprocess
import uuid

import pytest

from compress.errors import InputError
from compress.fileio import atomic_write_bytes, dumps
from conftest import HANG, compress_subprocess, file_bytes


def test_a_write_into_a_folder_names_the_file_and_keeps_what_was_there(tmp_path):
    os.makedirs(tmp_path / "out.json")
    with pytest.raises(InputError, match=r"cannot write '.*out.json': a folder is in its place; move the folder away"):
        atomic_write_bytes(tmp_path / "out.json", b"{}")
    assert os.listdir(tmp_path) == ["out.json"] and os.listdir(tmp_path / "out.json") == []  # no temp file left


@pytest.fixture
def mount_point(tmp_path):
    """Mounts made here (tmpfs, read-only binds) are unmounted after the test; skipped where mounting is not
    allowed (not root, or no CAP_SYS_ADMIN)."""
    mounted = []

    def mount(*args, target):
        os.makedirs(target, exist_ok=True)
        proc = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount here ({proc.stderr.strip()})")
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.mark.e2e
def test_a_full_disk_is_one_sentence_and_keeps_the_files_written(mount_point, tmp_path, tiny_config):
    """A full disk stops the run with one sentence, not `unexpected OSError: [Errno 28]`, and the files written
    stay."""
    disk = mount_point("-t", "tmpfs", "-o", "size=600k", "tmpfs", target=tmp_path / "disk")
    run = disk / "run"
    proc = compress_subprocess("run", "-c", tiny_config, "--run-dir", run, "--stages", "teacher", timeout=HANG)
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: cannot write '{run}/teacher/") and error.endswith(
        "': the disk is full; free space there (or use another --run-dir) and rerun the same command - the files "
        "already written are kept"), error
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr
    assert json.loads((run / "manifest.json").read_text())["format"] == "compress-run/1"  # still whole
    assert not [f for f in os.listdir(run / "teacher") if f.endswith(".tmp")]


def test_a_read_only_stage_folder_is_one_sentence_and_keeps_its_files(mount_point, run_copy):
    """A read-only stage folder stops the stage with one sentence, not `unexpected OSError: [Errno 30]`, and its
    files stay."""
    folder = run_copy / "export"
    mount_point("--bind", str(folder), target=folder)
    mount_point("-o", "remount,ro,bind", target=folder)
    before = file_bytes(run_copy)
    proc = compress_subprocess("run", "--run-dir", run_copy, "--stages", "export", "--force", timeout=HANG)
    assert proc.returncode == 2, proc.stderr
    assert f"error: cannot write '{folder}/" in proc.stderr and "': the file system is read-only; use another " \
        "--run-dir, or mount it writable" in proc.stderr, proc.stderr
    after = file_bytes(run_copy)
    assert {k: v for k, v in after.items() if k.startswith("export/")} == {
        k: v for k, v in before.items() if k.startswith("export/")}


@pytest.mark.e2e
def test_escape_sequences_from_names_never_reach_the_terminal_or_the_log(photos, tmp_path):
    """A class folder named with an ESC sequence reaches neither the terminal nor the log raw, in log lines or
    errors: a name must not drive the user's terminal."""
    root, _ = photos
    evil = "c\x1b[31mRED\x1b[0m\x07"
    for split in ("train", "val"):
        os.rename(root / split / "cat", root / split / evil)
    run = tmp_path / "run"
    proc = compress_subprocess("run", "--run-dir", run, "--stages", "teacher", "--set", "data.name=imagefolder",
                               "--set", f"data.root={root}", "--set", "data.image_size=8", "--set", "teacher.epochs=1",
                               "--set", "train.progress=false", timeout=HANG)
    assert proc.returncode == 0, proc.stderr
    assert "c\\x1b[31mRED\\x1b[0m\\x07" in proc.stderr  # shown, escaped
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr
    log = (run / "log.txt").read_text()
    assert "\x1b" not in log and "\x07" not in log
    bad = tmp_path / f"x\x1b[2J{uuid.uuid4().hex[:6]}"  # an error naming a path with an escape in it
    proc = compress_subprocess("run", "--run-dir", bad, "--stages", "teacher", "--set", "data.name=imagefolder",
                               "--set", f"data.root={bad}", timeout=HANG)
    assert proc.returncode == 2 and "x\\x1b[2J" in proc.stderr and "\x1b" not in proc.stderr, proc.stderr


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "file.bin"
    atomic_write_bytes(path, b"old")
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file.bin"], "no temp file may be left behind"


def test_json_files_are_strict():
    assert dumps({"a": float("nan"), "b": [float("inf"), 1.5]}) == '{"a": null, "b": [null, 1.5]}'
