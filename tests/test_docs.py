"""The README cannot drift from the code: config reference, CLI commands, CI's test command, and the deploy
snippet."""

import json
import os
import re
import subprocess

from compress import cli
from conftest import invoke, write_val_pngs

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


def test_the_readme_snippet_classifies_an_image_from_the_file_alone(finished_run, tmp_path):
    import re
    import subprocess
    import sys

    readme = open(os.path.join(ROOT, "README.md")).read()
    snippet = re.search(r"<!-- deploy-snippet -->\n```python\n(.*?)```", readme, re.S).group(1)
    assert len(snippet.strip().splitlines()) <= 15
    paths, _ = write_val_pngs(tmp_path, count=3)
    model = finished_run / "export" / "model.int8.onnx"
    expected = [e["top"][0]["class"] for e in json.loads(invoke("predict", model, *paths, "--json").stdout)]
    got = []
    for path in paths:
        code = snippet.replace('"model.int8.onnx"', repr(str(model))).replace('"digit.png"', repr(path))
        got.append(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                   .stdout.strip())
    assert got == expected
