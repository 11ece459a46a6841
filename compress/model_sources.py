"""Where models come from: `model.teacher` / `model.student` name one of

    deep_cnn, compact_cnn, resnet18, ...    a registry model (`compress models`)
    torchvision:<builder>                   any torchvision classification builder (resnet50, efficientnet_b0, ...)
    <module>:<function>                     your own code: `function(num_classes=, in_channels=, image_size=)`
                                            (it receives only the arguments its signature names) returns an
                                            nn.Module; the module is imported from the working directory or an
                                            installed package - it is code you trust, run as is

and `model.teacher_weights` / `model.student_weights` start it from a local file: `.safetensors`, or a PyTorch
state dict (`.pth`/`.pt`/`.bin`, read with `torch.load(weights_only=True)`: tensors only, never pickled code).
`module.` (DDP) and `_orig_mod.` (torch.compile) prefixes are stripped; a classifier head of another size is
replaced (one log line says so); any other mismatch is an error naming the keys.
"""

import difflib
import importlib
import inspect
import logging
import os
import sys

import torch
from torch import nn

from compress.checkpoint import key_mismatch
from compress.errors import InputError

log = logging.getLogger(__name__)

TORCHVISION = "torchvision:"
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "weights")


def torchvision_builders():
    import torchvision.models
    from torchvision.models import list_models

    return list_models(module=torchvision.models)


def source_problem(name):
    """Why `name` cannot be built, or None (checked before anything is written)."""
    from compress.models import MODELS

    if name in MODELS:
        return None
    if name.startswith(TORCHVISION):
        builder = name[len(TORCHVISION):]
        known = torchvision_builders()
        if builder in known:
            return None
        close = difflib.get_close_matches(builder, known, n=1)
        hint = f" (did you mean 'torchvision:{close[0]}'?)" if close else ""
        return (f"torchvision has no classification model '{builder}'{hint}; see "
                "torchvision.models.list_models() for the names")
    if ":" in name:
        try:
            _user_function(name)
        except InputError as e:
            return str(e)
        return None
    close = difflib.get_close_matches(name, list(MODELS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (f"unknown model '{name}'{hint}; choose one of {', '.join(MODELS)}, or torchvision:<builder>, or "
            "<module>:<function>")


def _user_function(name):
    module_name, _, function_name = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python -m`/console scripts: the working directory is where users' code is
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InputError(f"cannot import module '{module_name}' for model '{name}' ({e}); run compress from the "
                         "folder that holds it, or install it") from None
    except Exception as e:  # the user's module failed while importing: say where
        raise InputError(f"importing '{module_name}' for model '{name}' failed ({e.__class__.__name__}: "
                         f"{str(e)[:160]})") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise InputError(f"module '{module_name}' has no function '{function_name}' (model '{name}')")
    return fn


def build_from_source(name, in_channels, image_size, num_classes):
    """A torchvision or user model; registry names are built by compress.models.build_model."""
    if name.startswith(TORCHVISION):
        from torchvision.models import get_model_builder

        model = get_model_builder(name[len(TORCHVISION):])(weights=None, num_classes=num_classes)
        return adapt_input_channels(model, in_channels)
    fn = _user_function(name)
    offered = {"num_classes": num_classes, "in_channels": in_channels, "image_size": tuple(image_size)}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer everything
        params = {}
    takes_all = not params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    try:
        model = fn(**{k: v for k, v in offered.items() if takes_all or k in params})
    except Exception as e:
        raise InputError(f"model function '{name}' failed ({e.__class__.__name__}: {str(e)[:160]})") from None
    if not isinstance(model, nn.Module):
        raise InputError(f"model function '{name}' returned {type(model).__name__}, not a torch.nn.Module")
    return model


def adapt_input_channels(model, in_channels):
    """Replace the first convolution when the images have another channel count than the model expects."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                if child.in_channels != in_channels:
                    setattr(parent, child_name, nn.Conv2d(
                        in_channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                        child.dilation, child.groups if child.groups == 1 else in_channels, child.bias is not None))
                return model
    return model


# ---------------------------------------------------------------- weights files


def read_state_dict(path, key):
    """Tensors from a .safetensors or PyTorch state-dict file, wrapper prefixes stripped."""
    if not os.path.isfile(path):
        raise InputError(f"{key}: weights file '{path}' not found")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise InputError(f"{key}: '{path}' is not a readable safetensors file ({str(e)[:120]})") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError for pickled code; RuntimeError/EOFError for damaged files
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else e.__class__.__name__
            raise InputError(f"{key}: '{path}' is not a plain state dict that torch.load(weights_only=True) can read "
                             f"({first}); save `model.state_dict()` (or convert it to .safetensors)") from None
        state = _unwrap_checkpoint(state)
        if state is None:
            raise InputError(f"{key}: '{path}' holds no state dict (a mapping of parameter names to tensors); save "
                             "`model.state_dict()`")
    return {_strip(k): v for k, v in state.items()}


def _unwrap_checkpoint(obj):
    if isinstance(obj, dict) and obj and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
        return obj
    if isinstance(obj, dict):
        for key in STATE_DICT_KEYS:
            if key in obj:
                found = _unwrap_checkpoint(obj[key])
                if found is not None:
                    return found
    return None


def _strip(key):
    while key.startswith(("module.", "_orig_mod.")):
        key = key.split(".", 1)[1]
    return key


def head_keys(model):
    """State-dict keys of the classifier head: the last nn.Linear (or 1x1 Conv2d classifier) in the model."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            last = (name, module)
    if last is None:
        return set()
    name, module = last
    return {f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)}


def load_pretrained(model, path, key):
    """Load a weights file into `model`; a classifier head of another size keeps the model's own (fresh)
    head. Returns a one-line description of what was loaded."""
    state = read_state_dict(path, key)
    target = model.state_dict()
    heads = head_keys(model)
    replaced = {k: tuple(state[k].shape) for k in sorted(heads) if k in state and state[k].shape != target[k].shape}
    for k in replaced:
        state[k] = target[k]
    problem = key_mismatch(target, state, "wrong shape", lambda t, v: t.shape != v.shape,
                           lambda k, v: f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}")
    if problem:
        raise InputError(f"{key}: '{path}' does not fit this model ({problem}); is it a checkpoint of another "
                         "architecture?")
    model.load_state_dict({k: v.to(target[k].dtype) for k, v in state.items()}, strict=True)
    note = f"{key}: loaded {os.path.basename(path)}"
    weight = next((k for k in replaced if k.endswith("weight")), None)
    if weight:
        note += (f"; its classifier head {weight} {replaced[weight]} was replaced by a new one of shape "
                 f"{tuple(target[weight].shape)} (trained from scratch)")
    return note
