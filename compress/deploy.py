"""The deployment side: run an exported ONNX file with onnxruntime, numpy and Pillow only (no torch).

Everything needed to use the model travels inside the file as metadata (`compress.*` keys): class names,
input shape, channel order, normalisation mean/std. `OnnxModel` reads them, `preprocess` turns image files
into the exact tensors the model was trained on, `predict` gives top-k classes, `latency` times it.
"""

import json
import os
import statistics
import time

import numpy as np

from compress.errors import InputError

META_PREFIX = "compress."
REQUIRED_META = ("class_names", "input_shape", "channel_order", "mean", "std")
INT8_KERNELS = ("QLinearConv", "QLinearMatMul", "QGemm", "ConvInteger", "MatMulInteger", "QLinearAdd",
                "DynamicQuantizeMatMul", "MatMulIntegerToFloat")


def read_onnx(path):
    """The parsed onnx.ModelProto, or an InputError naming the file."""
    import onnx
    from google.protobuf.message import DecodeError

    if not os.path.isfile(path):
        raise InputError(f"ONNX file '{path}' not found")
    try:
        model = onnx.load(path)
    except (DecodeError, ValueError, RuntimeError, OSError) as e:
        raise InputError(f"'{path}' is not an ONNX model ({e.__class__.__name__}); pass a .onnx file "
                         "written by `compress run --stages export`") from None
    if not model.graph.node:
        raise InputError(f"'{path}' is not an ONNX model (no graph); pass a .onnx file written by compress")
    return model


def metadata_of(model_proto):
    meta = {}
    for prop in model_proto.metadata_props:
        if prop.key.startswith(META_PREFIX):
            key = prop.key[len(META_PREFIX):]
            try:
                meta[key] = json.loads(prop.value)
            except json.JSONDecodeError:
                meta[key] = prop.value
    return meta


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
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
            raise InputError(f"onnxruntime cannot load '{path}' ({str(e).splitlines()[0][:200]})") from None
        self.input_name = self.session.get_inputs()[0].name
        self.input_shape = tuple(self.meta.get("input_shape") or self._graph_input_shape())

    def _graph_input_shape(self):
        dims = self.session.get_inputs()[0].shape[1:]
        if not all(isinstance(d, int) for d in dims):
            raise InputError(f"'{self.path}' has no fixed input shape and no compress metadata giving one")
        return dims

    def __call__(self, batch):
        return self.session.run(None, {self.input_name: np.ascontiguousarray(batch, dtype=np.float32)})[0]

    def preprocess(self, image_paths):
        """Image files -> normalised NCHW float32, exactly as in training (resize, channels, mean/std)."""
        from PIL import Image, UnidentifiedImageError

        channels, height, width = self.input_shape
        mean = np.asarray(self.meta["mean"], dtype=np.float32).reshape(-1, 1, 1)
        std = np.asarray(self.meta["std"], dtype=np.float32).reshape(-1, 1, 1)
        out = []
        for path in image_paths:
            try:
                with Image.open(path) as im:
                    im = im.convert("L" if channels == 1 else "RGB")
                    if im.size != (width, height):
                        im = im.resize((width, height), Image.BILINEAR)
                    pixels = np.asarray(im, dtype=np.float32) / 255.0
            except FileNotFoundError:
                raise InputError(f"image '{path}' not found") from None
            except (UnidentifiedImageError, OSError) as e:
                raise InputError(f"cannot read image '{path}' ({e.__class__.__name__}); pass PNG/JPEG files") from None
            pixels = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
            out.append((pixels - mean) / std)
        return np.stack(out).astype(np.float32)

    def predict(self, image_paths, top_k=3):
        """[(path, [(class_name, probability), ...]), ...] for image files."""
        logits = self(self.preprocess(image_paths))
        probs = _softmax(logits)
        names = self.meta["class_names"]
        results = []
        for path, p in zip(image_paths, probs):
            order = np.argsort(-p)[:top_k]
            results.append((path, [(names[i], float(p[i])) for i in order]))
        return results

    def latency(self, batch_size, repeats=30, warmup=5, seed=0):
        """Median milliseconds per call for a batch (random normal inputs; the values do not matter)."""
        x = np.random.default_rng(seed).standard_normal((batch_size, *self.input_shape), dtype=np.float32)
        for _ in range(warmup):
            self(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self(x)
            times.append((time.perf_counter() - start) * 1000.0)
        return statistics.median(times)


def _softmax(logits):
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def latency_table(path, batch_sizes=(1, 64), threads=None, repeats=30, warmup=5):
    """[{batch, threads, ms, images_per_s}] for each batch size x thread count."""
    rows = []
    for t in threads or (1, os.cpu_count() or 1):
        model = OnnxModel(path, threads=t, require_metadata=False)
        for b in batch_sizes:
            ms = model.latency(b, repeats, warmup)
            rows.append({"batch": b, "threads": t, "ms": round(ms, 4), "images_per_s": round(b * 1000.0 / ms, 1)})
    return rows


def optimized_op_types(path):
    """Op counts of the graph onnxruntime actually runs (after its QDQ fusions), to prove int8 kernels."""
    import tempfile

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath).graph
    counts = {}
    for node in graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))
