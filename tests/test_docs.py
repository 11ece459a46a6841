"""The README cannot drift from the code: config reference, CLI commands, CI's test command."""

import os
import re
import subprocess

from compress import cli
from conftest import invoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_config_reference_in_readme_is_generated_from_the_dataclasses():
    section = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", README, re.S)
    assert section, "README lost its config-reference markers"
    assert section.group(1).strip() == invoke("config", "--reference").output.strip()


def test_every_command_is_documented():
    for name in cli.COMMANDS:
        assert f"### compress {name}\n" in README, f"README has no section for `compress {name}`"


def test_readme_starts_with_the_two_setup_commands_and_ci_runs_the_second():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert "compress run" in blocks[0] and "pip install -e ." in blocks[0]
    assert "pytest" in blocks[1]
    ci = subprocess.run(["awk", "/<!-- ci: test command -->/{getline; getline; print; exit}",
                         os.path.join(ROOT, "README.md")], capture_output=True, text=True).stdout.strip()
    assert ci == blocks[1].strip()
