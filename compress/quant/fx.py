"""FX graph-mode quantization: the QAT qconfig, prepare, freeze, convert, and rebuilding int8 from a file.

Why full-range activations: the x86 default qconfig observes activations with reduce_range (0..127), which
makes torch's int8 model (and its ONNX) drift from the fake-quant model it was trained as. Quantizing
activations over 0..255 with per-channel symmetric int8 weights keeps fake-quant, torch int8 and onnxruntime
within about one quantization step of each other (on the oneDNN engine, see set_engine).

Order under DDP: prepare the plain model, move it, then wrap it in DDP. Never prepare or convert a wrapper.
"""

import contextlib
import copy
import warnings

import torch

from compress.errors import CheckpointError, InputError

# The two warnings torch 2.14's FX quantization emits on every call; filtered only around those calls.
_KNOWN_WARNINGS = (
    (DeprecationWarning, r"torch\.ao\.quantization is deprecated"),
    (UserWarning, r".*quantized tensor"),
    # fixed-qparams ops (hardsigmoid, sigmoid, tanh in mobilenet_v3 and efficientnet) keep torch's own fixed
    # ranges whatever the QConfig says - once per op, four lines each, and nothing to act on
    (UserWarning, r"QConfig must specify a FixedQParamsObserver"),
)


@contextlib.contextmanager
def quiet_fx():
    with warnings.catch_warnings():
        for category, message in _KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def qconfig_mapping(backend="x86", activation_range="full", per_channel=True, float_layers=()):
    """The QConfigMapping for QAT: full-range activations and per-channel weights (see above), with the
    modules named in `float_layers` kept in float."""
    mapping = _base_mapping(backend, activation_range, per_channel)
    for name in float_layers:
        mapping.set_module_name(name, None)
    return mapping


def _base_mapping(backend, activation_range, per_channel):
    from torch.ao.quantization import (
        FusedMovingAvgObsFakeQuantize,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        QConfig,
        QConfigMapping,
        get_default_qat_qconfig_mapping,
    )

    if activation_range == "reduced":
        with quiet_fx(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*reduce_range will be deprecated", category=UserWarning)
            return get_default_qat_qconfig_mapping(backend)
    activation = FusedMovingAvgObsFakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
        qscheme=torch.per_tensor_affine, reduce_range=False)
    if per_channel:
        weight = FusedMovingAvgObsFakeQuantize.with_args(
            observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric)
    else:
        weight = FusedMovingAvgObsFakeQuantize.with_args(
            observer=MovingAverageMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
            qscheme=torch.per_tensor_symmetric)
    return QConfigMapping().set_global(QConfig(activation=activation, weight=weight))


def describe_qconfig(qcfg, float_layers=()):
    """What export needs to rebuild the same prepared model (stored in qat.safetensors' metadata)."""
    return {"backend": qcfg.backend, "activation_range": qcfg.activation_range, "per_channel": qcfg.per_channel,
            "float_layers": list(float_layers)}


BACKENDS, ACTIVATION_RANGES = ("x86", "qnnpack"), ("full", "reduced")  # qat.backend's and qat.activation_range's


def read_qconfig(value, path):
    """`describe_qconfig`'s record as read back from a file's metadata, checked: a record that is not one (a file
    edited by hand, or written by something else) is one CheckpointError naming the file."""
    problem = None
    if not isinstance(value, dict):
        problem = "is not a JSON object"
    elif value.get("backend") not in BACKENDS:
        problem = f"has backend {value.get('backend')!r}, not one of {', '.join(BACKENDS)}"
    elif value.get("activation_range") not in ACTIVATION_RANGES:
        problem = f"has activation_range {value.get('activation_range')!r}, not one of {', '.join(ACTIVATION_RANGES)}"
    elif not isinstance(value.get("per_channel"), bool):
        problem = "has no per_channel true or false"
    elif not (isinstance(value.get("float_layers", []), list)
              and all(isinstance(x, str) for x in value.get("float_layers", []))):
        problem = "has float_layers that are not a list of layer names"
    if problem:
        raise CheckpointError(f"'{path}' metadata 'qconfig' {problem} (the file was not written by the qat stage as "
                              "it is); rerun the qat stage with --force")
    return value


def set_engine(backend, activation_range="full"):
    """Select torch's int8 engine. x86 with full-range activations runs on oneDNN: fbgemm's depthwise kernel
    drifts from exact integer arithmetic when activations use all 8 bits (up to 70 steps on 144 channels, the
    kind of int16 overflow its default 7-bit activations, reduce_range, avoid), which put torch's int8
    mobilenet_v2 0.19 logits on average from its fake-quant model; on oneDNN it is 0.05, as onnxruntime's is."""
    supported = torch.backends.quantized.supported_engines
    if backend == "x86":
        preferred = ("onednn", "x86", "fbgemm") if activation_range == "full" else ("x86", "fbgemm")
    else:
        preferred = ("qnnpack",)
    engine = next((e for e in preferred if e in supported), None)
    if engine is None:
        raise InputError(f"qat.backend={backend} is not supported by this torch build "
                         f"(engines: {', '.join(supported)})")
    torch.backends.quantized.engine = engine


def prepare(model, example, backend="x86", activation_range="full", per_channel=True, float_layers=()):
    """prepare_qat_fx on a plain (never DDP-wrapped) float model in train mode: fuses conv-bn-relu and
    inserts fake-quant modules (none for `float_layers`). Untraceable models get an error naming the construct."""
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    set_engine(backend, activation_range)
    mapping = qconfig_mapping(backend, activation_range, per_channel, float_layers)
    try:
        with quiet_fx():
            return prepare_qat_fx(model.train(), mapping, (example,))
    except Exception as e:  # FX raises TraceError, TypeError, NotImplementedError... on unsupported code
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise InputError(f"{model.__class__.__name__} cannot be prepared for QAT by torch.fx "
                         f"({e.__class__.__name__}: {first[:200]})") from None


def convert(prepared):
    """int8 model from a deep copy of the (unwrapped) prepared model, on the CPU, in eval mode."""
    from torch.ao.quantization.quantize_fx import convert_fx

    with quiet_fx():
        return convert_fx(copy.deepcopy(prepared).cpu().eval())


def freeze_observers(prepared):
    from torch.ao.quantization import disable_observer

    prepared.apply(disable_observer)


def freeze_bn(prepared):
    from torch.ao.nn.intrinsic.qat import freeze_bn_stats

    prepared.apply(freeze_bn_stats)


def rebuild_int8(float_model, tensors, example, qconfig, path):
    """The int8 model from a float architecture and a prepared-model state: prepare (with the qconfig recorded
    in the file's metadata), load, convert."""
    from compress.training.checkpoint import load_into

    prepared = prepare(float_model, example, qconfig["backend"], qconfig["activation_range"], qconfig["per_channel"],
                       qconfig.get("float_layers", ()))
    load_into(prepared, tensors, path)
    return convert(prepared)


@contextlib.contextmanager
def observers_paused(prepared):
    """Evaluate a prepared model without its observers learning from the evaluation data (FakeQuantize
    observes whenever observer_enabled is set, in eval mode too)."""
    from torch.ao.quantization import FakeQuantizeBase

    saved = [(m, m.observer_enabled.clone()) for m in prepared.modules() if isinstance(m, FakeQuantizeBase)]
    for m, _ in saved:
        m.disable_observer()
    try:
        yield
    finally:
        for m, flag in saved:
            m.observer_enabled.copy_(flag)
