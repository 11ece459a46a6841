"""The runtimes an exported file is timed in: onnxruntime (always installed, run in this process) and OpenVINO
(an optional extra: `pip install -e ".[openvino]"`), which always runs in a child process of its own
(compress.deploy.openvino_child explains why)."""

import importlib.util
import os
import tempfile

import numpy as np

from compress.errors import InputError

RUNTIMES = ("onnxruntime", "openvino")


def installed(name):
    return name == "onnxruntime" or importlib.util.find_spec(name) is not None


def default_runtimes():
    """onnxruntime, and OpenVINO when its package is installed (onnxruntime first: it decides the verdict)."""
    return [name for name in RUNTIMES if installed(name)]


def check(name, path):
    """A clear error now for an unknown or missing runtime, or a file it cannot load."""
    if name not in RUNTIMES:
        raise InputError(f"unknown runtime '{name}'; choose one of {', '.join(RUNTIMES)}")
    if not installed(name):
        raise InputError(f"runtime {name} is not installed; pip install {name} (or pip install -e \".[{name}]\")")
    if name == "onnxruntime":
        from compress.deploy.onnx_model import OnnxModel

        OnnxModel(path, require_metadata=False)
    else:
        from compress.deploy.openvino_child import request

        request({"do": "check", "path": str(path)})


def onnxruntime_session(path, threads=None):
    """A callable running the ONNX file at `path` on the CPU in onnxruntime with `threads` threads."""
    from compress.deploy.onnx_model import OnnxModel

    return OnnxModel(path, threads=threads, require_metadata=False)


def compare_in_openvino(paths, images, threads, rounds, warmup=2):
    """compress.deploy.latency.compare_latency for files {name: path}, measured in an OpenVINO child process."""
    from compress.deploy.openvino_child import request

    with tempfile.TemporaryDirectory(prefix="compress-ov-") as tmp:
        npy = os.path.join(tmp, "images.npy")
        np.save(npy, np.ascontiguousarray(images, dtype=np.float32), allow_pickle=False)
        return request({"do": "compare", "paths": {k: str(p) for k, p in paths.items()}, "images": npy,
                        "threads": threads, "rounds": rounds, "warmup": warmup})
