"""Weights files the user brings (`model.teacher_weights` / `model.student_weights`): `.safetensors`, or a
PyTorch state dict (`.pth`/`.pt`/`.bin`, read with `torch.load(weights_only=True)`: tensors only, never pickled
code). `module.` (DDP) and `_orig_mod.` (torch.compile) prefixes are stripped; a classifier head of another
size is replaced (one log line says so); any other mismatch is an error naming the keys.
"""

import os

import torch
from torch import nn

from compress.errors import InputError

STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "weights")


def key_mismatch(target, tensors, wrong_label, is_wrong, describe):
    """'missing keys: a, b; unexpected keys: c; <wrong_label>: d ...' (first three of each), or '' when the
    keys of `tensors` fit the state dict `target`."""
    wrong = [describe(k, v) for k, v in target.items() if k in tensors and is_wrong(tensors[k], v)]
    parts = []
    for label, keys in (("missing keys", sorted(set(target) - set(tensors))),
                        ("unexpected keys", sorted(set(tensors) - set(target))), (wrong_label, wrong)):
        if keys:
            more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
            parts.append(f"{label}: {', '.join(keys[:3])}{more}")
    return "; ".join(parts)


def read_state_dict(path, key):
    """Tensors from a .safetensors or PyTorch state-dict file, wrapper prefixes stripped."""
    path = os.path.expanduser(path)
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
            first = _load_failure(e)
            raise InputError(f"{key}: '{path}' is not a plain state dict that torch.load(weights_only=True) can read "
                             f"({first}); save `model.state_dict()` (or convert it to .safetensors)") from None
        state = _unwrap_checkpoint(state)
        if state is None:
            raise InputError(f"{key}: '{path}' holds no state dict (a mapping of parameter names to tensors); save "
                             "`model.state_dict()`")
    return {_strip(k): v for k, v in state.items()}


def _load_failure(e):
    """What went wrong in torch.load, in words a user can act on: the object a pickle holds besides tensors (a
    whole module), a damaged zip in torch's own words; anything else - a bare key or struct error from reading
    some other file ('174812789', 'Unsupported operand 80') - as what it means."""
    text = str(e)
    detail = text.split("WeightsUnpickler error:", 1)[1].strip() if "WeightsUnpickler error:" in text else ""
    if detail.startswith("Unsupported global: GLOBAL "):
        name = detail.removeprefix("Unsupported global: GLOBAL ").split()[0]
        return f"it holds a pickled {name} object, not only tensors"
    if isinstance(e, RuntimeError) and not detail and text.strip():
        return text.strip().splitlines()[0].split(". ")[0][:160]  # "... failed finding central directory"
    return "not a file torch.save wrote, or a damaged one"


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
