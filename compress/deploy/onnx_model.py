"""An exported ONNX file run with onnxruntime, numpy and Pillow only (no torch).

Everything needed to use the model travels inside the file as metadata (`compress.*` keys): class names,
input shape, channel order, normalisation mean/std. `OnnxModel` reads them, `preprocess` turns image files
into the exact tensors the model was trained on; compress.deploy.evaluate predicts and measures accuracy with
it, compress.deploy.latency times it.
"""

import json
import os

import numpy as np

from compress import __version__
from compress.deploy.imageio import finite_list, load_pixels, normalise, printable
from compress.errors import InputError
from compress.fileio import read_bytes

META_PREFIX = "compress."
MAX_ZOOM = 4  # the largest shorter side over crop a resize rule can hold (data.eval_crop >= 0.25)
REQUIRED_META = ("class_names", "input_shape", "channel_order", "mean", "std")
INT8_KERNELS = ("QLinearConv", "QLinearMatMul", "QGemm", "ConvInteger", "MatMulInteger", "QLinearAdd",
                "DynamicQuantizeMatMul", "MatMulIntegerToFloat")


def deployment_metadata(model_name, data):
    """Everything a deployment needs to turn an image file into the model's input and its output into a class,
    in order, without guessing: the metadata export writes into every ONNX file (under META_PREFIX) and `OnnxModel`
    reads (compress.deploy.imageio implements exactly this; so does the snippet in docs/deployment.md). `data` is
    the run's DataBundle."""
    channels, height, width = data.input_shape
    color = "L" if channels == 1 else "RGB"
    conversion = "8-bit grayscale, L = 0.299 R + 0.587 G + 0.114 B" if channels == 1 else "8-bit RGB"
    rule = data.resize
    return {
        "model": model_name, "dataset": data.name, "class_names": list(data.class_names),
        "input_name": "input", "layout": "NCHW", "input_dtype": "float32", "input_shape": [channels, height, width],
        "color": color, "channel_order": "gray" if channels == 1 else "RGB",
        "resize": rule, "pixel_scale": "1/255", "mean": list(data.mean), "std": list(data.std),
        "preprocessing": [
            f"decode the image; convert to {color} ({conversion}; 16-bit or float images: scale to 0..1 first)",
            f"resize so the shorter side is {rule['shorter_side']} px (bilinear, antialiased, keep the aspect ratio)",
            f"centre-crop {height}x{width}",
            "uint8 0..255 -> float32, divide by 255",
            "subtract mean and divide by std, per channel",
            "HWC -> CHW, add the batch axis first (NCHW)"],
        "output": "logits: unnormalised class scores [batch, classes]; softmax gives probabilities; index i is "
                  "class_names[i]",
        "compress_version": __version__}


def read_onnx(path):
    """The parsed onnx.ModelProto, or an InputError naming the file."""
    import onnx
    from google.protobuf.message import DecodeError

    data = read_bytes(path, "ONNX file", limit=4 << 30, follow_links=True)
    try:
        model = onnx.load_from_string(data)
    except (DecodeError, ValueError, RuntimeError, OSError) as e:
        raise InputError(f"'{path}' is not an ONNX model ({e.__class__.__name__}); pass a .onnx file "
                         "written by `compress run --stages export`") from None
    if not model.graph.node:
        raise InputError(f"'{path}' is not an ONNX model (no graph); pass a .onnx file written by compress")
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in _tensors(model.graph)):
        # onnxruntime would read such weights from a file named inside the model, relative to the current folder
        raise InputError(f"'{path}' keeps weights in a separate file (ONNX external data); compress reads only "
                         "self-contained files, as its export writes them")
    return model


def _tensors(graph):
    """Every TensorProto of `graph`: its initializers and the tensors in node attributes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def batch_of(path, model_proto):
    """The fixed batch size of the file's one input, None where its batch dimension is dynamic; an InputError
    naming the file for a graph that takes anything but one input (compress feeds it one image batch)."""
    weights = {t.name for t in model_proto.graph.initializer}  # older files list their weights as inputs too
    inputs = [i for i in model_proto.graph.input if i.name not in weights]
    if len(inputs) != 1:
        names = ", ".join(printable(i.name, 40) for i in inputs[:4]) + (", ..." if len(inputs) > 4 else "")
        raise InputError(f"'{path}' has {len(inputs)} inputs{f' ({names})' if names else ''}; compress feeds one "
                         "image batch")
    dims = inputs[0].type.tensor_type.shape.dim
    return dims[0].dim_value if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0 else None


CONTROL_FLOW = ("Loop", "Scan", "If")  # no exported classifier holds one


def refuse_control_flow(path, proto):
    """An InputError for a graph with control flow: a Loop runs for as long as its inputs say, inside one native
    call that Ctrl-C cannot interrupt, and no classifier compress exports holds one."""
    loops = sorted({n.op_type for n in proto.graph.node if n.op_type in CONTROL_FLOW})
    if loops:
        raise InputError(f"'{path}' holds control flow ({', '.join(loops)}), which no classifier compress exports "
                         "has; re-export the model with `compress run --stages export`")


def fixed_batch_error(path, batch, fed):
    """The InputError for a file that takes a fixed batch of `batch` images, fed batches `fed` (words)."""
    return InputError(f"'{path}' takes a fixed batch of {batch} image{'s' if batch > 1 else ''}, but {fed}; export "
                      "it with a dynamic batch dimension")


def metadata_of(model_proto):
    meta = {}
    for prop in model_proto.metadata_props:
        if prop.key.startswith(META_PREFIX):
            key = prop.key[len(META_PREFIX):]
            try:
                meta[key] = json.loads(prop.value)
            except (ValueError, RecursionError):  # not JSON, or nested too deep to parse: kept as text, which
                meta[key] = prop.value  # OnnxModel refuses where a value is needed ("... re-export the model")
    return meta


SCORE_TYPES = ("tensor(float)", "tensor(float16)", "tensor(double)")


class OnnxModel:
    """An onnxruntime CPU session plus the preprocessing stored in the file."""

    def __init__(self, path, threads=None, require_metadata=True):
        import onnxruntime as ort

        proto = read_onnx(path)
        self.path, self.meta = path, metadata_of(proto)
        missing = [k for k in REQUIRED_META if k not in self.meta]
        if require_metadata and missing:
            raise InputError(f"'{path}' has no compress metadata for {', '.join(missing)}: it cannot be preprocessed "
                             "without them; export it with `compress run --stages export`")
        options = ort.SessionOptions()
        options.log_severity_level = 4  # fatal only: a node failing at run time is logged (in colour) as an error,
        # and compress says it in a sentence of its own (__call__)
        # The pool's threads spin within a call and sleep when it returns: left spinning, they hold the cores that
        # the next call of another session (the files a latency table times in turns) or our own preprocessing
        # needs. Ten tables of one run's fp32, QAT and PTQ int8 files (the two int8 graphs op-for-op identical),
        # batch 64: QAT/PTQ 0.92-1.05x with it, 0.67-1.60x without, and fp32 11.5 against 19.2 ms (median).
        options.add_session_config_entry("session.force_spinning_stop", "1")
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
            raise InputError(f"onnxruntime cannot load '{path}' ({str(e).splitlines()[0][:200]})") from None
        self.fixed_batch = batch_of(path, proto)
        self.input_name = self.session.get_inputs()[0].name
        if require_metadata:
            self._check_scores(proto)
            self._check_metadata()
        self.input_shape = tuple(self.meta["input_shape"] if "input_shape" in self.meta and require_metadata
                                 else self._graph_input_shape())

    def _check_scores(self, proto):
        """Refuse a file whose graph is not the classifier compress exports - float scores (batch, classes), no
        control flow (a Loop can run for as long as its inputs say) - before an image is read."""
        refuse_control_flow(self.path, proto)
        out = self.session.get_outputs()[0]
        if out.type not in SCORE_TYPES or len(out.shape or ()) != 2:
            raise InputError(f"'{self.path}' outputs {printable(str(out.type), 40)} of shape "
                             f"{printable(str(out.shape), 60)}, not the float class scores (batch, classes) compress "
                             "reads; re-export the model with `compress run --stages export`")

    def _check_metadata(self):
        """Refuse metadata that would silently give wrong answers (a std of 0, a mean per wrong channel count)."""
        m, where = self.meta, f"'{self.path}' metadata"
        shape = m.get("input_shape")
        if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and 0 < v <= 8192 for v in shape)
                and shape[0] in (1, 3)):
            raise InputError(f"{where} compress.input_shape must be [channels (1 or 3), height, width]; got "
                             f"{str(shape)[:80]}; re-export the model")
        for key in ("mean", "std"):
            if not finite_list(m.get(key)) or len(m[key]) != shape[0]:
                raise InputError(f"{where} compress.{key} must hold {shape[0]} finite number(s), one per channel; got "
                                 f"{str(m.get(key))[:80]}; re-export the model")
        if any(v <= 0 for v in m["std"]):
            raise InputError(f"{where} compress.std must be positive; got {m['std']}; re-export the model")
        from compress.run.schema import MIN_STD  # the bound a config's data.std is held to

        # pixels are scaled to 0..1: a std far below MIN_STD (1e-300) turns them into infinities, and one above its
        # inverse flattens every image to its mean: either way the scores are not the model's answer
        if any(not MIN_STD <= v <= 1 / MIN_STD for v in m["std"]):
            raise InputError(f"{where} compress.std must hold values between {MIN_STD:g} and {1 / MIN_STD:g}, as a "
                             f"config's data.std does; got {m['std']}; re-export the model")
        names = m.get("class_names")
        outputs = self.session.get_outputs()[0].shape
        classes = outputs[-1] if outputs and isinstance(outputs[-1], int) else None
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)) or (
                classes is not None and len(names) != classes):
            raise InputError(f"{where} compress.class_names must list the model's {classes or 'output'} class "
                             "names; re-export the model")
        rule = m.get("resize")
        if rule is not None and not (isinstance(rule, dict) and all(
                isinstance(rule.get(k), int) and 0 < rule[k] <= 16384 for k in ("shorter_side", "height", "width"))):
            raise InputError(f"{where} compress.resize is malformed; re-export the model")
        graph = [d if isinstance(d, int) else None for d in self.session.get_inputs()[0].shape[1:]]
        if len(graph) == 3 and any(g is not None and g != v for g, v in zip(graph, shape)):
            raise InputError(f"{where} compress.input_shape {shape} disagrees with the graph's input "
                             f"{['?' if g is None else g for g in graph]}; re-export the model")
        if rule is not None:  # the crop is what the graph is fed: any other size fails inside the runtime
            height, width = shape[1:]
            if (rule["height"], rule["width"]) != (height, width):
                raise InputError(f"{where} compress.resize crops {rule['height']}x{rule['width']} images, but the "
                                 f"model's input is {height}x{width}; re-export the model")
            if rule["shorter_side"] < max(height, width):
                raise InputError(f"{where} compress.resize's shorter_side {rule['shorter_side']} is smaller than its "
                                 f"{height}x{width} crop; re-export the model")
            if rule["shorter_side"] > MAX_ZOOM * max(height, width):  # data.eval_crop is at least 1 / MAX_ZOOM
                raise InputError(f"{where} compress.resize's shorter_side {rule['shorter_side']} is more than "
                                 f"{MAX_ZOOM} times its {height}x{width} crop (an export's is at most that); "
                                 "re-export the model")
            for key, applied in (("interpolation", "bilinear"), ("crop", "center")):
                if rule.get(key, applied) != applied:
                    raise InputError(f"{where} compress.resize's {key} is {printable(rule[key], 40)!r}, but compress "
                                     f"resizes and crops one way ({key} {applied!r}); re-export the model")

    def _graph_input_shape(self):
        dims = self.session.get_inputs()[0].shape[1:]
        if not all(isinstance(d, int) for d in dims):
            raise InputError(f"'{self.path}' has no fixed input shape and no compress metadata giving one")
        return dims

    def __call__(self, batch):
        try:
            return self.session.run(None, {self.input_name: np.ascontiguousarray(batch, dtype=np.float32)})[0]
        except _run_errors() as e:  # a node failing on these inputs (the file loaded): one sentence naming it
            first = (str(e).splitlines() or [""])[0]
            raise InputError(f"onnxruntime failed to run '{self.path}': {printable(first, 300)}") from None

    def scores(self, batch):
        """The outputs for a batch of any size, as predict and eval feed it: a file that takes a fixed batch of
        one image is run an image at a time; one of several images is refused."""
        if self.fixed_batch is None or self.fixed_batch == len(batch):
            return self(batch)
        if self.fixed_batch == 1:
            return np.concatenate([self(batch[i:i + 1]) for i in range(len(batch))])
        raise fixed_batch_error(self.path, self.fixed_batch, "compress feeds batches of any size")

    @property
    def resize(self):
        """The file's resize rule (older files, without one: the input size, centre-cropped)."""
        _, height, width = self.input_shape
        return self.meta.get("resize") or {"shorter_side": min(height, width), "height": height, "width": width}

    def preprocess(self, image_paths):
        """Image files -> normalised NCHW float32, exactly as the validation images were in training."""
        channels = self.input_shape[0]
        out = [normalise(load_pixels(path, channels, self.resize), self.meta["mean"], self.meta["std"])
               for path in image_paths]
        return np.stack(out).astype(np.float32)

    def class_names(self):
        """The class names, printable (control characters escaped, length capped)."""
        return [printable(n) for n in self.meta["class_names"]]


def _run_errors():
    """The types onnxruntime raises when a loaded file fails to run (looked up only once one is raised)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    return Fail, InvalidArgument, RuntimeException


def optimized_op_types(path):
    """Op counts of the graph onnxruntime actually runs (after its QDQ fusions), to prove int8 kernels."""
    import tempfile

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 4  # fatal only, as OnnxModel's
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath).graph
    counts = {}
    for node in graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))
