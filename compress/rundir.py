"""The run directory and its manifest: what each stage did, with which config, from which inputs.

    <run>/config.yaml      the resolved config of the latest `compress run` in this folder
    <run>/manifest.json    per stage: status, config hash, input/output sha256, metrics, timings, versions
    <run>/<stage>/...      the stage's outputs; <stage>/last/ holds its resume checkpoint

Only rank 0 writes here, always atomically.
"""

import datetime
import json
import os
import platform

from compress.checkpoint import atomic_write_json, atomic_write_text
from compress.errors import InputError

MANIFEST_FORMAT = "compress-run/1"
STATUSES = ("running", "complete", "failed", "interrupted")


class RunDir:
    def __init__(self, root):
        self.root = os.path.abspath(os.path.expanduser(root))

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def rel(self, path):
        return os.path.relpath(path, self.root)

    @property
    def manifest_path(self):
        return self.path("manifest.json")

    @property
    def config_path(self):
        return self.path("config.yaml")

    def resume_checkpoint(self, stage):
        return self.path(stage, "last", "checkpoint.safetensors")

    def exists(self):
        return os.path.isfile(self.manifest_path)

    def prepare(self):
        """Create the folder and prove we can write into it, before any work starts."""
        probe = self.path(".write-test")
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.unlink(probe)
        except OSError as e:
            raise InputError(f"cannot write to run directory '{self.root}' ({e.strerror or e}); "
                             "choose another with --run-dir") from None

    def write_config(self, text):
        atomic_write_text(self.config_path, text)

    # ------------------------------------------------------------ manifest

    def manifest(self):
        path = self.manifest_path
        if not os.path.exists(path):
            return {"format": MANIFEST_FORMAT, "stages": {}}
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"manifest '{path}' is not valid JSON ({e.__class__.__name__}); restore it, or move "
                             "it away to rerun every stage from scratch") from None
        except OSError as e:
            raise InputError(f"cannot read manifest '{path}' ({e.strerror or e})") from None
        problem = _manifest_problem(data)
        if problem:
            raise InputError(f"manifest '{path}' is not a compress manifest ({problem}); restore it, or move it "
                             "away to rerun every stage from scratch")
        return data

    def stage_entry(self, stage):
        return self.manifest()["stages"].get(stage)

    def update_stage(self, stage, **fields):
        data = self.manifest()
        entry = data["stages"].setdefault(stage, {})
        entry.update(fields)
        atomic_write_json(self.manifest_path, data)
        return entry


def _manifest_problem(data):
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        return f"no \"format\": \"{MANIFEST_FORMAT}\""
    stages = data.get("stages")
    if not isinstance(stages, dict):
        return "\"stages\" is not a mapping"
    for name, entry in stages.items():
        if not isinstance(entry, dict) or entry.get("status") not in STATUSES:
            return f"stage '{name}' has no valid status"
        if not isinstance(entry.get("outputs", {}), dict) or not isinstance(entry.get("inputs", {}), dict):
            return f"stage '{name}' has malformed inputs/outputs"
    return None


def file_check(run, rel, sha):
    """'ok', 'missing' or 'modified' for a file the manifest recorded."""
    from compress.checkpoint import sha256_file

    path = run.path(rel)
    if not os.path.isfile(path):
        return "missing"
    return "ok" if sha256_file(path) == sha else "modified"


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions():
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torchvision", "onnx", "onnxruntime", "safetensors"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            pass
    from compress import __version__
    found["compress"] = __version__
    return found
