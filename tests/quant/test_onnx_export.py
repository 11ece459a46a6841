"""Torch -> ONNX (compress.quant.onnx_export): registry models export, pass the checker and match onnxruntime;
a second ONNX implementation agrees with onnxruntime on the exported files."""

import numpy as np
import onnx
import pytest
import torch

from compress.data.datasets import load_data
from compress.deploy.onnx_model import OnnxModel
from compress.models.registry import build_model
from compress.quant.onnx_export import export_onnx
from compress.run.config import load_config


@pytest.mark.parametrize("name,shape", [("light_cnn", (3, 32, 32)), ("deep_cnn", (1, 28, 28)),
                                        pytest.param("resnet18", (3, 32, 32), marks=pytest.mark.e2e)])  # ~4 s
def test_registry_models_export_check_and_match_onnxruntime(tmp_path, name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 10).eval()
    path = tmp_path / "m.onnx"
    export_onnx(model, torch.randn(2, *shape), path, 17, {"class_names": list("abcdefghij")})
    onnx.checker.check_model(onnx.load(path), full_check=True)
    session = OnnxModel(str(path), require_metadata=False)
    x = torch.randn(5, *shape)  # a batch size the export never saw: the batch axis is dynamic
    with torch.no_grad():
        expected = model(x).numpy()
    assert np.abs(session(x.numpy()) - expected).max() < 1e-3


def test_onnx_reference_evaluator_agrees_with_onnxruntime(finished_run):
    """A second, independent ONNX implementation (onnx.reference) runs both files: 100 % top-1 agreement with
    onnxruntime in fp32, >= 99 % in int8, on validation images."""
    from onnx.reference import ReferenceEvaluator

    data = load_data(load_config(None, ["data.name=digits"]).data, seed=0)
    x = data.val.batch(range(100)).x.numpy()
    for kind, needed in (("fp32", 1.0), ("int8", 0.99)):
        path = finished_run / "export" / f"model.{kind}.onnx"
        reference = ReferenceEvaluator(onnx.load(path)).run(None, {"input": x})[0]
        runtime = OnnxModel(str(path))(x)
        assert (reference.argmax(1) == runtime.argmax(1)).mean() >= needed, kind


def test_what_the_exporters_cpp_side_writes_to_stderr_goes_to_the_log(capfd):
    """C++ warnings are written to file descriptor 2 itself, past Python's warnings machinery: they are routed to
    the py.warnings logger (log.txt; the terminal only with -v), not left on the terminal."""
    import logging
    import os

    from compress.quant.onnx_export import native_warnings_to_log

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    keep, logger = Keep(), logging.getLogger("py.warnings")  # its own handler: the CLI tests unset propagation
    logger.addHandler(keep)
    try:
        with native_warnings_to_log():
            os.write(2, b"[W1127 shape_type_inference.cpp:1994] Warning: The shape inference is missing\n\n"
                        b"a line a Python handler wrote\n")
        os.write(2, b"after\n")
    finally:
        logger.removeHandler(keep)
    assert keep.lines == ["[W1127 shape_type_inference.cpp:1994] Warning: The shape inference is missing"]
    # what was not a native warning is passed on as written (no log line twice with -v); fd 2 is itself again
    assert capfd.readouterr().err == "a line a Python handler wrote\nafter\n"
    import subprocess
    import sys

    code = "from compress.quant.onnx_export import native_warnings_to_log as n\nwith n(): print('ran')"
    closed = subprocess.run([sys.executable, "-c", code], stderr=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True, preexec_fn=lambda: os.close(2))
    assert closed.returncode == 0 and closed.stdout == "ran\n"  # no stderr at all (`2>&-`): nothing to capture
