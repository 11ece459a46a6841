"""The docs cannot drift from the code: the README's two set-up commands (CI runs the second) and its length,
the config reference (docs/configuration.md), every command's section (docs/cli.md), and the deploy snippet
(docs/deployment.md) classifying an image from the file alone."""

import json
import os
import re
import subprocess

from compress import cli
from conftest import invoke, write_val_pngs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def doc(name):
    with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
        return f.read()


def test_the_config_reference_is_generated_from_the_dataclasses():
    section = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->",
                        doc("configuration.md"), re.S)
    assert section, "docs/configuration.md lost its config-reference markers"
    generated = invoke("config", "--reference").output.strip()
    stale = [line for line in generated.splitlines() if line not in section.group(1).splitlines()]
    assert section.group(1).strip() == generated, (
        "docs/configuration.md's reference is not what `compress config --reference` prints now; paste its output "
        "between the config-reference markers. First row that differs: " + (stale[0] if stale else "(rows removed)"))


def test_every_command_is_documented():
    commands = doc("cli.md")
    for name in cli.COMMANDS:
        assert f"### compress {name}\n" in commands, f"docs/cli.md has no section for `compress {name}`"


def test_the_readme_is_one_screenful_per_question():
    assert len(README.splitlines()) <= 250


def test_every_link_to_a_markdown_file_resolves():
    names = [n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")]
    pages = {"README.md": README} | {f"docs/{n}": doc(n) for n in names}
    broken = [(page, link) for page, text in pages.items()
              for link in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", text)
              if not os.path.exists(os.path.join(ROOT, os.path.dirname(page), link))]
    assert not broken, broken


def test_links_into_benchmarks_land_on_a_heading():
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                 for h in re.findall(r"^#+ (.+)$", f.read(), re.M)}
    texts = [README] + [doc(name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")]
    links = [a for text in texts for a in re.findall(r"BENCHMARKS\.md#([\w-]+)", text)]
    assert links and all(a in slugs for a in links), sorted(set(links) - slugs)


def test_readme_starts_with_the_two_setup_commands_and_ci_runs_the_second():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert "compress run" in blocks[0] and "pip install -e ." in blocks[0]
    assert "pytest" in blocks[1]
    ci = subprocess.run(["awk", "/<!-- ci: test command -->/{getline; getline; print; exit}",
                         os.path.join(ROOT, "README.md")], capture_output=True, text=True).stdout.strip()
    assert ci == blocks[1].strip()


def test_the_deploy_snippet_classifies_an_image_from_the_file_alone(finished_run, tmp_path):
    import sys

    snippet = re.search(r"<!-- deploy-snippet -->\n```python\n(.*?)```", doc("deployment.md"), re.S).group(1)
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
