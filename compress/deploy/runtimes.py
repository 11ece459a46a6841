"""The runtimes an exported file is run and timed in: onnxruntime (always installed) and OpenVINO (an optional
extra: `pip install -e ".[openvino]"`). Each gives a session: a callable from float32 NCHW images to logits."""

import importlib.util

import numpy as np

from compress.errors import InputError

RUNTIMES = ("onnxruntime", "openvino")


def installed(name):
    return name == "onnxruntime" or importlib.util.find_spec(name) is not None


def default_runtimes():
    """onnxruntime, and OpenVINO when its package is installed (onnxruntime first: it decides the verdict)."""
    return [name for name in RUNTIMES if installed(name)]


def session(name, path, threads=None):
    """A callable running the ONNX file at `path` on the CPU in runtime `name` with `threads` threads."""
    if name == "onnxruntime":
        from compress.deploy.onnx_model import OnnxModel

        return OnnxModel(path, threads=threads, require_metadata=False)
    if name != "openvino":
        raise InputError(f"unknown runtime '{name}'; choose one of {', '.join(RUNTIMES)}")
    if not installed("openvino"):
        raise InputError("runtime openvino is not installed; pip install openvino (or pip install -e \".[openvino]\")")
    import openvino as ov

    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", **({"INFERENCE_NUM_THREADS": int(threads)} if threads else {})}
    try:
        compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
    except RuntimeError as e:
        raise InputError(f"OpenVINO cannot load '{path}' ({str(e).splitlines()[0][:200]})") from None
    request, output = compiled.create_infer_request(), compiled.output(0)

    def run(batch):
        return request.infer({0: np.ascontiguousarray(batch, dtype=np.float32)})[output]

    return run
