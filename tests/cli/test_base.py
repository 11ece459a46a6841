"""The command group (compress.cli.base): the command dict is the CLI, every --help teaches with an example,
--version in-process and from the installed script, and library warnings kept to the run's log."""

import textwrap

import pytest

from compress import __version__, cli
from conftest import compress_subprocess, invoke


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
