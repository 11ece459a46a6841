"""torch -> ONNX: export with the TorchScript exporter (the one that handles convert_fx int8 models, as
QuantizeLinear/DequantizeLinear with int8 weights), attach metadata, check, and write atomically."""

import contextlib
import io
import json
import warnings

import torch

from compress.checkpoint import atomic_write_bytes
from compress.deploy import META_PREFIX
from compress.errors import StageFailed


@contextlib.contextmanager
def _quiet_legacy_exporter():
    # dynamo=False is deliberate (TOOLCHAIN.md: the only exporter that handles convert_fx output), so its
    # "legacy exporter" and torch.jit.trace deprecation notices are expected; nothing else is filtered.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message="The feature will be removed", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.trace", category=FutureWarning)
        yield


def export_onnx(model, example, path, opset, metadata):
    """Write `model` (eval, CPU) to `path` as one self-contained ONNX file with a dynamic batch axis and
    `compress.*` metadata; onnx.checker (full check) must pass. Returns the ModelProto."""
    import onnx

    buffer = io.BytesIO()
    try:
        with _quiet_legacy_exporter(), torch.no_grad():
            torch.onnx.export(model.eval(), (example,), buffer, dynamo=False, opset_version=opset,
                              input_names=["input"], output_names=["logits"],
                              dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    except Exception as e:  # the exporter raises many types for unsupported operators
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise StageFailed(f"export: torch.onnx.export failed for {path} ({first[:200]})") from None
    proto = onnx.load_from_string(buffer.getvalue())
    for key, value in metadata.items():
        prop = proto.metadata_props.add()
        prop.key, prop.value = META_PREFIX + key, value if isinstance(value, str) else json.dumps(value)
    proto.producer_name = "compress"
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as e:
        raise StageFailed(f"export: onnx.checker rejected {path}: {str(e).splitlines()[0][:200]}") from None
    atomic_write_bytes(path, proto.SerializeToString())
    return proto
