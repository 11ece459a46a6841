"""torch -> ONNX: export with the TorchScript exporter (the one that handles convert_fx int8 models, as
QuantizeLinear/DequantizeLinear with int8 weights), attach metadata, check, and write atomically."""

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import warnings

import torch

from compress.deploy.onnx_model import META_PREFIX
from compress.errors import StageFailed
from compress.fileio import atomic_write_bytes, dumps
from compress.quant.qdq import clean_qdq


@contextlib.contextmanager
def _quiet_legacy_exporter():
    # dynamo=False is deliberate (torch 2.14: the only exporter that handles convert_fx int8 models), so its
    # "legacy exporter" and torch.jit.trace deprecation notices are expected; nothing else is filtered.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message="The feature will be removed", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.trace", category=FutureWarning)
        # quantized activations (hardtanh/ReLU6 in mobilenets) read their scale as a Python number while tracing
        warnings.filterwarnings("ignore", message="Converting a tensor to a Python", category=torch.jit.TracerWarning)
        yield


@contextlib.contextmanager
def native_warnings_to_log():
    """What the exporter's C++ side writes straight to file descriptor 2 ("[W...] Warning: The shape inference
    of prim::TupleConstruct type is missing") routed like the Python libraries' warnings: into the run's log.txt,
    onto the terminal only with -v. Only the native warning lines ("[W...") are logged; anything else written
    there meanwhile (a Python warning shown with -v) is passed on as it was."""
    def keep(text):
        passed = []
        for line in text.splitlines():
            if NATIVE_WARNING.match(line):
                logging.getLogger("py.warnings").warning("%s", line)
            elif line.strip():
                passed.append(line + "\n")
        return "".join(passed)

    with _held(2, sys.stderr, keep):
        yield


@contextlib.contextmanager
def graph_dumps_dropped():
    """The TorchScript exporter prints its whole graph to file descriptor 1 when an operator does not export
    ("Torch IR graph at exception: graph(...", thousands of lines); the error itself says what failed. What it
    writes there is passed on without that dump."""
    with _held(1, sys.stdout, lambda text: text.split("Torch IR graph at exception", 1)[0]):
        yield


@contextlib.contextmanager
def _held(fd, stream, keep):
    """What native code writes to file descriptor `fd` (Python's `stream` on it) meanwhile, held in an anonymous
    temporary file - never a pipe, which a full buffer would block - and passed on as `keep(text)` returns it.
    Where the descriptor is closed (`2>&-`), or no temporary file can be made, nothing is held."""
    try:
        if stream is not None:
            stream.flush()
        saved = os.dup(fd)
    except (OSError, ValueError):
        yield
        return
    try:
        held = tempfile.TemporaryFile()
    except OSError:
        os.close(saved)
        yield
        return
    with held:
        os.dup2(held.fileno(), fd)
        try:
            yield
        finally:
            _flush_c_stdio()
            if stream is not None:
                stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            held.seek(0)
            text = keep(held.read().decode("utf-8", "replace"))
            if text:
                os.write(fd, text.encode("utf-8", "replace"))


def _flush_c_stdio():
    """fflush(NULL): what C and C++ code buffered reaches the file it was written for, not the terminal after the
    descriptor is given back."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to call (an unusual platform): nothing buffered
        pass


NATIVE_WARNING = re.compile(r"\[W\d{4} ")  # c10's warning prefix: [W<month><day> <time> <thread> <file>:<line>]


EXPORTER_MAX_OPSET = 20  # the TorchScript exporter's newest; newer opsets come from onnx's version converter


def export_onnx(model, example, path, opset, metadata, proto=None):
    """Write `model` (eval, CPU) to `path` as one self-contained ONNX file with a dynamic batch axis and
    `compress.*` metadata; onnx.checker (full check) must pass. Returns the ModelProto. Given `proto` (an
    already exported and tidied graph, e.g. onnxruntime's PTQ output), only the last steps run: the opset,
    the metadata, the check and the atomic write."""
    import onnx

    if proto is None:
        proto = tidy(_trace(model, example, path, opset))
    if proto.opset_import[0].version < opset:
        from onnx import version_converter

        proto = version_converter.convert_version(proto, opset)
    for key, value in metadata.items():
        prop = proto.metadata_props.add()
        prop.key, prop.value = META_PREFIX + key, value if isinstance(value, str) else dumps(value)
    proto.producer_name = "compress"
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as e:
        raise StageFailed(f"export: onnx.checker rejected {path}: {str(e).splitlines()[0][:200]}") from None
    atomic_write_bytes(path, proto.SerializeToString())
    return proto


def _trace(model, example, path, opset):  # noqa: D401 - used by compress.quant.ptq too
    """The TorchScript exporter's graph of `model` (the one exporter that handles convert_fx int8 models)."""
    import onnx

    buffer = io.BytesIO()
    try:
        with _quiet_legacy_exporter(), native_warnings_to_log(), graph_dumps_dropped(), torch.no_grad():
            torch.onnx.export(model.eval(), (example,), buffer, dynamo=False,
                              opset_version=min(opset, EXPORTER_MAX_OPSET),
                              input_names=["input"], output_names=["logits"],
                              dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    except Exception as e:  # the exporter raises many types for unsupported operators
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise StageFailed(f"export: torch.onnx.export failed for {path} ({first[:200]})") from None
    return onnx.load_from_string(buffer.getvalue())


def tidy(proto, keep_node_names=False):
    """Fold what the TorchScript exporter leaves as computations on constants into initializers (Constant,
    Identity or Cast of a constant, ConstantOfShape of a constant shape), clean the QDQ pattern
    (`compress.qdq`) and give internal tensors short names. The graph computes exactly the same thing (the
    export stage re-checks parity); for a small int8 model the exporter's per-node overhead is otherwise a
    large part of the file."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    consts = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    kept = []
    for node in graph.node:
        value = _fold(node, consts, helper, numpy_helper)
        if value is None:
            kept.append(node)
        else:
            consts[node.output[0]] = value
    clean_qdq(kept, consts)
    used = {name for node in kept for name in node.input} | {o.name for o in graph.output}
    names = _short_names(graph, kept, used, consts)
    for node in kept:
        node.input[:] = [names.get(n, n) for n in node.input]
        node.output[:] = [names.get(n, n) for n in node.output]
        if not keep_node_names:
            node.name = ""
    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(numpy_helper.from_array(v, names[k]) for k, v in consts.items() if k in used)
    del graph.value_info[:]
    return proto


def _fold(node, consts, helper, numpy_helper):
    import numpy as np

    if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
        return numpy_helper.to_array(node.attribute[0].t)
    if node.op_type == "Identity" and node.input[0] in consts:
        return consts[node.input[0]]
    if node.op_type == "Cast" and node.input[0] in consts:
        to = helper.get_attribute_value(node.attribute[0])
        return consts[node.input[0]].astype(helper.tensor_dtype_to_np_dtype(to))
    if node.op_type == "ConstantOfShape" and node.input[0] in consts:
        fill = numpy_helper.to_array(node.attribute[0].t) if node.attribute else np.zeros(1, np.float32)
        return np.full(tuple(consts[node.input[0]].tolist()), fill.reshape(-1)[0], dtype=fill.dtype)
    return None


def _short_names(graph, nodes, used, consts):
    """Graph inputs/outputs keep their names; everything else becomes w<i> (constants) or t<i> (activations)."""
    keep = {i.name for i in graph.input} | {o.name for o in graph.output}
    names = {}
    for name in consts:
        if name in used and name not in keep:
            names[name] = f"w{len(names)}"
    count = 0
    for node in nodes:
        for out in node.output:
            if out and out not in keep and out not in names:
                names[out] = f"t{count}"
                count += 1
    return names
