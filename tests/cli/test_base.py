"""The command group (compress.cli.base): the command dict is the CLI, every --help teaches with an example,
--version in-process and from the installed script, library warnings kept to the run's log, and a standard output
that cannot be written said in one line."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from compress import __version__, cli
from conftest import compress_subprocess, invoke, write_val_pngs


def test_command_dict_matches_the_cli():
    assert set(cli.COMMANDS) == set(cli.cli.commands)
    for name, command in cli.COMMANDS.items():
        assert cli.cli.commands[name] is command


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_help_teaches_with_an_example(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output


@pytest.mark.e2e
def test_version_in_process_and_installed_script():
    assert __version__ in invoke("--version").output
    proc = compress_subprocess("--version")
    assert proc.returncode == 0 and __version__ in proc.stdout


@pytest.mark.e2e
def test_library_warnings_go_to_the_runs_log_not_the_terminal(tmp_path, tiny_config):
    """A model that warns on every forward pass: the terminal stays ours; log.txt keeps the warnings; -v shows
    them too."""
    (tmp_path / "noisy.py").write_text(textwrap.dedent("""
        import warnings
        import torch

        class Noisy(torch.nn.Module):
            def __init__(self, num_classes, in_channels):
                super().__init__()
                self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_channels * 64, num_classes))

            def forward(self, x):
                warnings.warn("noisy library warning", UserWarning)
                return self.body(x)

        def build(num_classes, in_channels):
            return Noisy(num_classes, in_channels)
        """))
    args = ["run", "-c", tiny_config, "--stages", "teacher", "--set", "model.teacher=noisy:build",
            "--set", "teacher.epochs=1"]
    quiet = compress_subprocess(*args, "--run-dir", tmp_path / "quiet", cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert "noisy library warning" not in quiet.stderr
    assert "noisy library warning" in (tmp_path / "quiet" / "log.txt").read_text()
    loud = compress_subprocess(*args, "--run-dir", tmp_path / "loud", "-v", cwd=tmp_path)
    assert "noisy library warning" in loud.stderr


def _with_stdout(stdout, *args):
    """The installed script with its standard output `stdout`: a file object, or None for a closed one (`>&-`)."""
    exe = shutil.which("compress") or os.path.join(os.path.dirname(sys.executable), "compress")
    if stdout is None:
        return subprocess.run(["bash", "-c", 'exec "$@" >&-', "bash", exe, *map(str, args)], stderr=subprocess.PIPE,
                              text=True, timeout=180)
    return subprocess.run([exe, *map(str, args)], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=180)


@pytest.mark.e2e
@pytest.mark.parametrize("command", [("models",), ("config",)])
def test_standard_output_that_cannot_be_written_is_one_line_naming_it(command):
    """Output to a full disk (/dev/full) or a closed standard output (`>&-`): one line that says standard output, not
    a run directory, and a non-zero exit; a reader that left (`| head`) is no error, and nothing is said."""
    with open("/dev/full", "w") as full:
        result = _with_stdout(full, *command)
    assert result.returncode != 0 and result.stderr.startswith("error: cannot write to standard output ("), \
        result.stderr
    assert len(result.stderr.splitlines()) == 1 and "--run-dir" not in result.stderr and "Traceback" not in \
        result.stderr
    closed = _with_stdout(None, *command)
    assert closed.returncode != 0 and closed.stderr.startswith("error: cannot write to standard output ("), \
        closed.stderr
    assert len(closed.stderr.splitlines()) == 1
    read, write = os.pipe()
    os.close(read)  # the reader left before the first line
    with os.fdopen(write, "w") as gone:
        piped = _with_stdout(gone, *command)
    assert piped.returncode == 0 and piped.stderr == ""


def test_a_run_whose_table_cannot_be_printed_still_succeeds(run_copy):
    """`compress run >&-` (cron, a detached job): the stages' work is done and the table is in report.md, so the
    exit code is the run's (0), with one line saying where the table is."""
    result = _with_stdout(None, "run", "--run-dir", run_copy)  # a full disk (/dev/full) takes the same path
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the run is complete, but its table was not printed (cannot write to standard output (it is closed)" \
        in result.stderr and f"it is in {run_copy / 'report.md'}" in result.stderr, result.stderr[-2000:]


def test_the_runtimes_write_nothing_in_the_home_folder(finished_run, tmp_path):
    """onnxruntime keeps a device id and an event database under ~/.cache/Microsoft unless told not to
    (ORT_DISABLE_TELEMETRY), and `import openvino` writes a client id under ~/intel for its usage events unless
    its telemetry package cannot load: timing and running a model write nothing outside the run."""
    import importlib.util

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ORT_DISABLE_TELEMETRY", "XDG_CACHE_HOME")}
    exe = os.path.join(os.path.dirname(sys.executable), "compress")
    commands = [("bench", finished_run, "--repeats", "2")]
    if importlib.util.find_spec("openvino"):
        commands.append(("bench", finished_run, "--repeats", "2", "--runtime", "openvino"))
    for command in commands:
        result = subprocess.run([exe, *map(str, command)], capture_output=True, text=True, timeout=180,
                                env={**env, "HOME": str(home)})
        assert result.returncode == 0, result.stderr[-2000:]
    assert [str(p.relative_to(home)) for p in home.rglob("*")] == []


def test_show_and_predict_say_standard_output_cannot_be_written(finished_run, tmp_path):
    """`compress show RUN > /dev/full` and `compress predict RUN img >&-`: one line naming standard output, a
    non-zero exit; never silence with exit 0, nor a full disk blamed on the run directory."""
    paths, _ = write_val_pngs(tmp_path, count=1)
    for command in (("show", finished_run), ("predict", finished_run, *paths)):
        with open("/dev/full", "w") as full:
            result = _with_stdout(full, *command)
        closed = _with_stdout(None, *command)
        for run in (result, closed):
            assert run.returncode != 0, (command, run.stderr)
            assert "error: cannot write to standard output (" in run.stderr and "--run-dir" not in run.stderr, \
                run.stderr
            assert "Traceback" not in run.stderr


def test_the_transports_words_for_a_lost_peer_are_cut_at_a_word_without_source_locations():
    from compress.errors import peer_loss_words

    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:17536: "
            "Connection reset by peer. This is typically caused by a remote process exiting")
    assert peer_loss_words(gloo) == "Read error [127.0.0.1]:17536: Connection reset by peer"
    long = "word " * 60
    assert peer_loss_words(long).endswith("word ...") and len(peer_loss_words(long)) <= 124


def test_a_lost_peer_says_the_launcher_restarts_the_group_where_it_has_restarts_left():
    """Under --max-restarts the launcher restarts the group itself: the worker does not tell the user to rerun
    (nor to pass the flag already given); without restarts left it does."""
    from compress.errors import peer_loss_text

    line = "Connection reset by peer"
    ours = {"COMPRESS_LAUNCH_ATTEMPT": "0", "COMPRESS_LAUNCH_MAX_RESTARTS": "2", "TORCHELASTIC_MAX_RESTARTS": "0"}
    assert peer_loss_text(line, ours).endswith("; the launcher restarts the group (2 restart(s) left), which resumes "
                                               "from the last checkpoint")
    spent = {**ours, "COMPRESS_LAUNCH_ATTEMPT": "2"}
    assert peer_loss_text(line, spent).endswith("; rerun the same command to resume from the last checkpoint")
    assert peer_loss_text(line, {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3"}).endswith(
        "(3 restart(s) left), which resumes from the last checkpoint")  # torchrun by hand
    assert peer_loss_text(line, {}).endswith("rerun the same command to resume from the last checkpoint - with "
                                             "--max-restarts N the group restarts and resumes by itself")


@pytest.mark.e2e
def test_torchrun_variables_left_in_the_environment(tmp_path):
    """RANK alone (a shell that once ran a distributed job) is no launch: the run is one process, rank 0, and
    says its errors. RANK outside WORLD_SIZE is one sentence naming both. RANK 0 of a WORLD_SIZE 2 whose peer never
    comes says what it waits for, and Ctrl-C/SIGTERM end the wait at once, not after the 30-minute timeout."""
    import signal
    import time

    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    stray = compress_subprocess("run", "--run-dir", tmp_path / "stray", "--dry-run", env={**base, "RANK": "1"})
    assert stray.returncode == 0 and "teacher" in stray.stdout, stray.stderr
    said = compress_subprocess("run", "--run-dir", tmp_path / "stray", "--set", "teacher.lr=-1", "--dry-run",
                               env={**base, "RANK": "1"})  # rank 1's errors were left to a rank 0 that is not there
    assert said.returncode == 2 and "error: config error in --set: teacher.lr" in said.stderr, said.stderr
    bad = compress_subprocess("run", "--run-dir", tmp_path / "bad", "--stages", "teacher",
                              env={**base, "RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "29731"})
    assert bad.returncode == 2 and "RANK=3 is not one of WORLD_SIZE=2's ranks (0 to 1)" in bad.stderr, bad.stderr
    exe = shutil.which("compress") or os.path.join(os.path.dirname(sys.executable), "compress")
    proc = subprocess.Popen([exe, "run", "--run-dir", str(tmp_path / "alone"), "--stages",
                             "teacher"], stderr=subprocess.PIPE, text=True,
                            env={**base, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": "29733"})
    waited = ""
    for line in proc.stderr:  # said once the wait has lasted WAIT_SAID_AFTER_S
        waited += line
        if "waiting for the other 1 process(es) of WORLD_SIZE=2 at 127.0.0.1:29733" in line:
            break
    time.sleep(1)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert time.monotonic() - start < 30 and proc.returncode != 0, waited


def test_a_stray_rank_alone_makes_a_one_process_group_of_rank_0(monkeypatch):
    from compress.training.distributed import process_group

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with process_group("cpu", threads=1) as env:
        assert (env.rank, env.world, env.is_main, env.distributed) == (0, 1, True, False)


def test_launcher_variables_that_are_not_numbers_are_one_sentence_naming_them(monkeypatch):
    """RANK=abc, WORLD_SIZE=abc, a restart count of 'abc': one sentence naming the variable, not 'unexpected
    ValueError'."""
    from compress.errors import InputError
    from compress.run.launch import first_attempt
    from compress.torchrun import env_count
    from compress.training.distributed import process_group

    assert env_count("X", 3, {}) == 3 and env_count("X", 3, {"X": "7"}) == 7
    with pytest.raises(ValueError, match=r"^X='-1' is not a whole number >= 0; it comes from torchrun"):
        env_count("X", 0, {"X": "-1"})
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match=r"^RANK='abc' is not a whole number"):
        with process_group("cpu", threads=1):
            pass
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "abc")
    with pytest.raises(InputError, match=r"^TORCHELASTIC_RESTART_COUNT='abc' is not a whole number"):
        first_attempt()


def test_ctrl_c_in_a_command_other_than_run_is_said_without_the_pipelines_words():
    """predict, eval, bench have no stages to resume: their Ctrl-C line does not speak of them."""
    from compress.cli.base import cli

    @cli.command("interrupted-for-a-test")
    def _stopped():
        raise KeyboardInterrupt

    try:
        result = invoke("interrupted-for-a-test")
    finally:
        cli.commands.pop("interrupted-for-a-test")
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1] == "stopped: interrupted (Ctrl-C)"
