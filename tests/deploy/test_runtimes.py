"""The latency runtimes are one registry (compress.deploy.runtimes.RUNTIMES): the config, the CLI and the docs
name the same ones, every installed runtime times a real file by the one protocol, and a runtime registered as
docs/extending.md says is used end to end - by an export and by `compress bench` - with nothing else changed."""

import json
import os
import re
import subprocess
import sys
import typing

import pytest

from compress.deploy.runtimes import RUNTIMES
from compress.run.config import ExportConfig
from conftest import ROOT


def _literal_choices(tp):
    """The Literal values inside Optional[tuple[Literal[...], ...]]."""
    if typing.get_origin(tp) is typing.Literal:
        return tuple(typing.get_args(tp))
    return next(c for a in typing.get_args(tp) if (c := _literal_choices(a)))


def test_runtime_names_agree_in_the_registry_the_config_the_cli_and_the_docs():
    from compress.cli import COMMANDS

    names = tuple(RUNTIMES)
    assert names[0] == "onnxruntime"  # always installed, so always first: it decides the verdict
    assert _literal_choices(typing.get_type_hints(ExportConfig)["runtimes"]) == names
    runtime_option = next(p for p in COMMANDS["bench"].params if p.name == "runtime")
    assert tuple(runtime_option.type.choices) == names
    assert all(r.label in runtime_option.help or name in runtime_option.help for name, r in RUNTIMES.items())
    reference = open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8").read()
    row = re.search(r"^\| `export\.runtimes` \| list of (.*?) or null \|", reference, re.M)
    assert row and tuple(row.group(1).split(" | ")) == names, "regenerate docs/configuration.md's reference"


def test_the_config_loads_no_runtime():
    """The config imports the registry; that must not load onnxruntime or openvino (nor torch)."""
    code = ("import sys; from compress.run.config import load_config; "
            "load_config(None, ['export.runtimes=[openvino]']); "
            "print(sorted(m for m in ('onnxruntime', 'openvino', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", list(RUNTIMES))
def test_every_installed_runtime_times_a_real_file_by_the_protocol(finished_run, name):
    """Each registered runtime, the ones added later too: a latency table of two real exported files, each
    cell with its rounds, and a refusal in one sentence for a file it cannot load."""
    from compress.deploy.latency import latency_tables
    from compress.errors import InputError

    if not RUNTIMES[name].available():
        pytest.skip(f"{name} is not installed")
    export = finished_run / "export"
    paths = {k: export / f"model.{k}.onnx" for k in ("fp32", "int8")}
    tables = latency_tables(paths, (1, 4), threads=(1,), repeats=3, warmup=1, runtime=name)
    assert set(tables) == {"fp32", "int8"}
    for cells in tables.values():
        assert [(c["batch"], c["threads"]) for c in cells] == [(1, 1), (4, 1)]
        assert all(c["ms"] > 0 and len(c["round_ms"]) == 5 and c["ms"] == sorted(c["round_ms"])[2] for c in cells)
    with pytest.raises(InputError, match="export.json"):
        RUNTIMES[name].check(export / "export.json")


def example_block():
    """The runtime docs/extending.md adds, as written there."""
    text = open(os.path.join(ROOT, "docs", "extending.md"), encoding="utf-8").read()
    return re.search(r"<!-- runtime-example -->\n```python\n(.*?)```", text, re.S).group(1)


# docs/extending.md's block, registered before the CLI is built (as an entry in runtimes.py would be), its
# sessions logged to $OPENED so the test sees which files the new runtime opened; then the real CLI
SCRIPT = """
import os, sys
from compress.deploy.runtimes import RUNTIMES, in_process
exec(compile(open(sys.argv.pop(1)).read(), "docs/extending.md", "exec"))
basic = RUNTIMES["onnxruntime-basic"]

def logged(path, threads):
    with open(os.environ["OPENED"], "a") as f:
        f.write(f"{os.path.basename(str(path))} {threads}\\n")
    return onnxruntime_basic_session(path, threads)

RUNTIMES["onnxruntime-basic"] = in_process(basic.label, logged, basic.package, basic.install, basic.default)
from compress.cli import main
main(sys.argv[1:])
"""


def test_a_runtime_added_as_docs_extending_says_is_used_end_to_end(run_copy, tmp_path):
    block, opened = tmp_path / "block.py", tmp_path / "opened.txt"
    block.write_text(example_block())
    env = {**os.environ, "OPENED": str(opened), "PYTHONUNBUFFERED": "1"}

    def compress(*args):
        return subprocess.run([sys.executable, "-c", SCRIPT, str(block), *map(str, args)], capture_output=True,
                              text=True, env=env, timeout=600)

    listed = compress("run", "--run-dir", run_copy, "--dry-run", "--set", "export.runtimes=[nosuch]")
    assert "must be one of onnxruntime, openvino, onnxruntime-basic" in listed.stderr, listed.stderr
    done = compress("run", "--run-dir", run_copy, "--stages", "export", "--set",
                    "export.runtimes=[onnxruntime, onnxruntime-basic]")
    assert done.returncode == 0, done.stderr
    export = json.loads((run_copy / "export" / "export.json").read_text())
    assert list(export["runtimes"]) == ["onnxruntime", "onnxruntime-basic"]
    assert set(export["runtimes"]["onnxruntime-basic"]) == {"fp32", "int8", "ptq"}
    seen = opened.read_text().split()
    assert {"model.fp32.onnx", "model.int8.onnx", "model.ptq.onnx"} <= set(seen)  # its sessions timed the files
    metrics = json.loads((run_copy / "manifest.json").read_text())["stages"]["export"]["metrics"]
    t = metrics["other_runtimes"]["onnxruntime-basic"]
    assert (f"- In onnxruntime, basic optimisations (batch {t['batch']}, {t['threads']} threads): int8 "
            f"{t['int8']:.3f} ms against fp32 {t['fp32']:.3f} ms") in (run_copy / "report.md").read_text()
    opened.write_text("")
    bench = compress("bench", run_copy, "--runtime", "onnxruntime-basic", "--batch", "2", "--threads", "1", "--json")
    assert bench.returncode == 0, bench.stderr
    answer = json.loads(bench.stdout)
    assert answer["runtime"] == "onnxruntime-basic" and len(answer["files"]) == 3
    assert opened.read_text().split().count("1") >= 3  # opened at one thread: checked, then timed
    helped = compress("bench", "--help")
    assert "onnxruntime-basic" in helped.stdout
