"""Weights files the user brings (`model.teacher_weights` / `model.student_weights`): `.safetensors`, or a
PyTorch state dict (`.pth`/`.pt`/`.bin`, read with `torch.load(weights_only=True)`: tensors only, never pickled
code), alone or inside a checkpoint (under 'state_dict', 'model', ... or the one top-level entry that is a state
dict). `module.` (DDP) and `_orig_mod.` (torch.compile) prefixes are stripped, and so is one leading `<word>.`
(Lightning's `model.`, `net.`, ...) when without it the keys fit the model; a classifier head of another size,
or none at all (backbone-only weights), gets a new head trained from scratch (the note returned says so); a
first convolution made for another number of image channels is named as such; any other mismatch is an error
naming the keys. Weights that fit but hold NaN or infinite values (as stored, or once cast to the model's dtype),
store as integers what the model keeps as floating point, or are not dense CPU tensors of values (sparse, meta), are
refused naming the tensor; a path that is not a regular file (a device, a pipe, a folder) is refused without being
opened.
"""

import logging
import os
import re
import stat

import torch
from torch import nn

from compress.errors import InputError
from compress.fileio import open_regular, sha256_file

log = logging.getLogger(__name__)

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


def path_problem(path, key):
    """Why `path` cannot be read as a weights file (missing; a device, pipe or folder), or ''. Only looked at,
    never opened: opening a FIFO would wait for a writer."""
    path = os.path.expanduser(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        named = "." not in os.path.basename(path)  # 'imagenet', 'resnet18': meant as a name, not a file
        return f"{key}: weights file '{path}' not found" + (
            "; torchvision's ImageNet weights are named `pretrained` or `torchvision:IMAGENET1K_V1`" if named else "")
    except OSError as e:
        return f"{key}: cannot read '{path}' ({e.strerror or e}); check the path and its permissions"
    if not stat.S_ISREG(mode):
        return f"{key}: '{path}' is not a regular file (a device, pipe or folder); pass a .safetensors or .pth file"
    return ""


def read_state_dict(path, key, entry=None):
    """Tensors from a .safetensors or PyTorch state-dict file, wrapper prefixes stripped. The file is opened only
    once it is known to be a regular file, and read through that one descriptor (never blocking on a pipe).
    `entry` (a list), when given, receives the words saying which entry of a checkpoint held them."""
    path = os.path.expanduser(path)
    problem = path_problem(path, key)
    if problem:
        raise InputError(problem)
    try:
        fd = open_regular(path, "weights file", follow_links=True)
    except InputError as e:  # replaced or made unreadable since it was looked at
        raise InputError(f"{key}: {e}") from None
    with os.fdopen(fd, "rb") as f:
        try:
            return _read_open(f, path, key, entry if entry is not None else [])
        except InputError as e:
            cached = _cache_damage(path, key)
            raise (InputError(cached) if cached else e) from None


def _cache_damage(path, key):
    """For an unreadable file in torch's weights cache whose content does not match the sha256 its name carries:
    one sentence saying so and how to get the right one back; '' otherwise (the reader's own message stands)."""
    import torch.hub

    folder = os.path.join(torch.hub.get_dir(), "checkpoints")
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder):
        return ""
    expected = unpublished(path)
    if not expected:
        return ""
    return (f"{key}: '{path}' in torch's weights cache is not the file torchvision publishes (its sha256 does not "
            f"begin with {expected} as its name says: a damaged or different file); delete it and rerun to download "
            "it again, or place the right file there")


def _read_open(f, path, key, entry):
    """The state dict in the open file `f` (read from `path`), wrapper prefixes stripped; which entry of a
    checkpoint held it appended to `entry`."""
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load as load_bytes

        try:
            state = load_bytes(f.read())
        except (SafetensorError, OSError, ValueError) as e:
            raise InputError(f"{key}: '{path}' is not a readable safetensors file ({str(e)[:120]})") from None
    else:
        try:
            loaded = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError for pickled code; RuntimeError/EOFError for damaged files
            first = _load_failure(e)
            if _damaged(e):
                raise InputError(f"{key}: '{path}' is damaged or cut short ({first}); copy or download it again") \
                    from None
            raise InputError(f"{key}: '{path}' is not a plain state dict that torch.load(weights_only=True) can read "
                             f"({first}); save `model.state_dict()` (or convert it to .safetensors)") from None
        state = _unwrap_checkpoint(loaded)
        if state is None:
            raise InputError(_no_state_dict(loaded, path, key))
        entry.extend(_entry_words(loaded, state))
    return {_strip(k): v for k, v in state.items()}


def _damaged(e):
    """torch.load's failure is a file torch.save wrote, cut short or corrupted (its zip archive or a record in it),
    not another kind of file."""
    text = str(e)
    return isinstance(e, EOFError) or any(words in text for words in (
        "failed finding central directory", "PytorchStreamReader failed", "file not found in archive",
        "Ran out of input"))


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


NEW_HEAD = "trained from scratch"  # in load_pretrained's note when the file gave the model no head of its own
AUX_HEADS = ("aux1", "aux2", "AuxLogits")  # torchvision googlenet / inception_v3 training-only heads
# in load_pretrained's note for a file whose head is for another number of classes: its shape's first dimension
_REPLACED_HEAD = re.compile(r"; its classifier head \S+ \((\d+)\b")


def _is_state_dict(obj):
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) and torch.is_tensor(v)
                                                       for k, v in obj.items())


def _unwrap_known(obj):
    """The state dict `obj` is, or holds under one of STATE_DICT_KEYS (at any depth), or None."""
    if _is_state_dict(obj):
        return obj
    if isinstance(obj, dict):
        for key in STATE_DICT_KEYS:
            if key in obj:
                found = _unwrap_known(obj[key])
                if found is not None:
                    return found
    return None


def _unwrap_checkpoint(obj):
    """The state dict in a loaded file: the file itself, the one under a known wrapper key, or else the single
    top-level entry that is one (`{'net': state_dict, 'epoch': 3}`); None when there is none, or several."""
    found = _unwrap_known(obj)
    if found is not None or not isinstance(obj, dict):
        return found
    candidates = [found for found in map(_unwrap_known, obj.values()) if found is not None]
    return candidates[0] if len(candidates) == 1 else None


def _entry_words(loaded, state):
    """[] for a file that is the state dict itself; else ["its 'model' entry"], with the other top-level entries that
    hold a state dict too (an EMA copy beside the model: timm's 'state_dict_ema') named as left aside."""
    if loaded is state or not isinstance(loaded, dict):
        return []
    taken = next((k for k, v in loaded.items() if v is state or _unwrap_known(v) is state), None)
    if taken is None:
        return []
    others = [repr(k) for k, v in loaded.items() if k != taken and _unwrap_known(v) is not None]
    words = f"its {taken!r} entry"
    if others:
        words += (f"; it also holds {', '.join(others[:3])}, left aside: to load that one, save it alone, e.g. "
                  f"torch.save(checkpoint[{others[0]}], 'weights.pth')")
    return [words]


def _no_state_dict(obj, path, key):
    """The error for a file with no state dict to take: several candidates named, or its top-level keys."""
    several = [repr(k) for k, v in obj.items() if _unwrap_known(v) is not None] if isinstance(obj, dict) else []
    if len(several) > 1:
        shown = ", ".join(several[:5]) + (f" (+{len(several) - 5} more)" if len(several) > 5 else "")
        return (f"{key}: '{path}' holds {len(several)} state dicts (under {shown}), so which one to load is "
                f"unclear; save the one meant alone, e.g. torch.save(checkpoint[{several[0]}], 'weights.pth')")
    if isinstance(obj, dict) and obj:
        keys = [repr(k) for k in obj]
        held = f"its top-level keys are {', '.join(keys[:8])}" + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")
    else:
        held = "it is an empty dict" if isinstance(obj, dict) else f"it holds a {type(obj).__name__}"
    return (f"{key}: '{path}' holds no state dict (a mapping of parameter names to tensors; {held}); save "
            "`model.state_dict()`")


def _strip(key):
    while key.startswith(("module.", "_orig_mod.")):
        key = key.split(".", 1)[1]
    return key


def _first_word(keys):
    """The '<word>.' every key starts with, or None."""
    words = {k.split(".", 1)[0] + "." if "." in k else None for k in keys}
    return words.pop() if len(words) == 1 and None not in words else None


def _keys_fit(state, target, heads):
    """Whether `state`'s keys are the model's, bar a classifier head it lacks altogether."""
    return not set(state) - set(target) and set(target) - set(state) <= heads


def _strip_prefix(state, target, heads):
    """(state, prefix): `state` without one leading '<word>.' shared by all its keys, or by all of its keys the
    model lacks, when without it the keys fit the model (prefix '' when nothing was stripped)."""
    if _keys_fit(state, target, heads):
        return state, ""
    unmatched = [k for k in state if k not in target]
    for prefix, keys in ((_first_word(state), list(state)), (_first_word(unmatched), unmatched)):
        if not prefix:
            continue
        renamed = {k: _strip(k[len(prefix):]) for k in keys if k.startswith(prefix)}
        stripped = {renamed.get(k, k): v for k, v in state.items()}
        if len(stripped) == len(state) and _keys_fit(stripped, target, heads):
            return stripped, prefix
    return state, ""


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


def _first_conv_weight(model):
    """State-dict key of the weight of the model's first (ungrouped) convolution, which sees the image's
    channels, or None."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return f"{name}.weight" if module.groups == 1 else None
    return None


def _channel_hint(model, state, target):
    """The sentence for weights whose first convolution was made for another number of image channels (and
    that fit the model otherwise), or ''."""
    k = _first_conv_weight(model)
    if k is None or k not in state or set(state) != set(target):
        return ""
    theirs, ours = tuple(state[k].shape), tuple(target[k].shape)
    if len(theirs) != 4 or theirs[1] == ours[1] or theirs[:1] + theirs[2:] != ours[:1] + ours[2:]:
        return ""
    if any(state[n].shape != v.shape for n, v in target.items() if n != k):
        return ""
    n, m = theirs[1], ours[1]
    return (f"the weights expect {n}-channel images and the data has {m} channel{'s' if m > 1 else ''}; set "
            f"data.channels={n} (an imagefolder dataset) or use weights made for {m}-channel images")


def _stem_hint(model, state, target):
    """The sentence for weights that fit the model but for the first convolution's kernel (torchvision's ImageNet
    resnet18, 7x7, into compress's registry resnet18, whose stem is 3x3 for small images), or ''."""
    k = _first_conv_weight(model)
    if k is None or k not in state or set(state) != set(target) or state[k].dim() != 4:
        return ""
    if any(state[n].shape != v.shape for n, v in target.items() if n != k) or state[k].shape[:2] != target[k].shape[:2]:
        return ""
    theirs, ours = "x".join(map(str, state[k].shape[2:])), "x".join(map(str, target[k].shape[2:]))
    return (f"the weights' first convolution is {theirs} and this model's {ours}: they were made for another variant "
            "of this architecture (torchvision's ImageNet weights need the torchvision:<name> model, not the "
            "registry's small-image one)")


def _family(model_name):
    """The letters a model name's architecture family starts with ('torchvision:resnet18', 'resnet10_half': 'resnet';
    'mobilenet_v3_small': 'mobilenet'), or ''."""
    m = re.match(r"[a-z]+", (model_name or "").split(":")[-1].lower())
    return m.group(0) if m and len(m.group(0)) >= 3 else ""


def _fits_apart_from_head(state, candidate):
    """Whether `state` holds exactly `candidate`'s tensors (same keys, same shapes), bar its classifier head."""
    heads = head_keys(candidate)
    target = candidate.state_dict()
    body = {k: v for k, v in target.items() if k not in heads}
    return (all(k in state and tuple(state[k].shape) == tuple(v.shape) for k, v in body.items())
            and set(state) - set(body) <= heads)


def _architecture_hint(state, model_name, key):
    """For weights that do not fit the model: the sentence naming the torchvision architecture of the model's family
    they do fit (resnet34's weights given to a resnet18), or ''. Candidates are built on the meta device: shapes
    without values, a fraction of a second for a family."""
    family = _family(model_name)
    if not family:
        return ""
    import torchvision
    from torchvision.models import get_model, list_models

    own = _builder_of(model_name) if model_name.startswith("torchvision:") else None
    for name in list_models(module=torchvision.models):
        if family not in name or name == own:
            continue
        try:
            with torch.device("meta"):
                candidate = get_model(name)
        except Exception:  # noqa: BLE001 - a builder that cannot run on the meta device is not a candidate
            continue
        if _fits_apart_from_head(state, candidate):
            return (f"its keys and shapes are those of torchvision's {name}: set {key.removesuffix('_weights')}="
                    f"torchvision:{name}, or give weights made for {model_name}")
    return ""


def and_more(keys):
    """'<first key>', or '<first key> (and N more tensors)'."""
    more = len(keys) - 1
    return keys[0] + (f" (and {more} more tensor{'s' if more > 1 else ''})" if more else "")


def _finite(v, dtype):
    """Whether `v` holds no NaN or infinity, as stored and once cast to the model's `dtype` (1e300 in a float64
    file is inf as float32)."""
    cast = v.to(dtype) if v.dtype != dtype else None  # the same dtype: one check of the tensor as stored
    return all(bool(torch.isfinite(t).all()) for t in (v, cast) if t is not None and t.is_floating_point())


def _value_problem(state, target):
    """What makes weights that fit the model's keys and shapes unusable, or '': a tensor that is not a dense CPU
    one of values (sparse, meta: checked first, as the other checks cannot read them), a tensor stored as integers
    where the model's is floating-point (integer buffers, such as BatchNorm's num_batches_tracked, may stay
    integers), or NaN or infinite values, which no training or evaluation can recover from."""
    keys = [k for k in target if k in state]
    odd = [k for k in keys if state[k].layout != torch.strided or state[k].device.type != "cpu"]
    if odd:
        if state[odd[0]].is_meta:
            return (f"holds {and_more(odd)} as a meta tensor (a shape without values); save the state dict of a model "
                    "whose weights hold values, not one built on the meta device")
        layout = str(state[odd[0]].layout).removeprefix("torch.")
        return (f"holds {and_more(odd)} as a {layout} tensor, not a dense one; save the state dict with dense CPU "
                "tensors (`tensor.to_dense()`)")
    integers = [k for k in keys if target[k].is_floating_point() and not state[k].is_floating_point()]
    if integers:
        return (f"stores {and_more(integers)} as {state[integers[0]].dtype} where the model has floating-point "
                "weights; save the state dict with its float tensors")
    bad = [k for k in keys if not _finite(state[k], target[k].dtype)]
    if bad:
        return f"holds NaN or infinite values in {and_more(bad)}; it cannot be used as weights - pass another file"
    return ""


def load_pretrained(model, path, key, model_name=None):
    """Load a weights file into `model` (built from the config's `model_name`, which names, in a refusal, the
    torchvision architecture of its family the file fits instead); a classifier head of another size, or none in
    the file, leaves the model's own (fresh) head. Returns a one-line description of what was loaded. Every refusal
    (an unreadable file, keys or shapes that do not fit, integer or non-finite tensors) is an InputError raised
    before `model` is touched."""
    entry = []
    state = read_state_dict(path, key, entry)
    target = model.state_dict()
    heads = head_keys(model)
    state, prefix = _strip_prefix(state, target, heads)
    aux = sorted({k.split(".")[0] for k in state if k.split(".")[0] in AUX_HEADS and k not in target})
    state = {k: v for k, v in state.items() if k.split(".")[0] not in aux}  # googlenet/inception, built without
    common = _first_word(state)
    replaced = {k: tuple(state[k].shape) for k in sorted(heads) if k in state and state[k].shape != target[k].shape}
    whole_head_absent = heads and not heads & set(state) and _keys_fit(state, target, heads)
    absent = sorted(heads) if whole_head_absent else []  # backbone-only weights
    # one head tensor that does not fit (the bias alone, too) makes the whole head a new one: the model's own
    new_head = sorted(heads) if replaced else []
    for k in [*new_head, *absent]:
        state[k] = target[k]
    problem = key_mismatch(target, state, "wrong shape", lambda t, v: t.shape != v.shape,
                           lambda k, v: f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}")
    if problem:
        hint = (_channel_hint(model, state, target) or _stem_hint(model, state, target)
                or _architecture_hint(state, model_name, key))
        if hint:
            raise InputError(f"{key}: '{path}' does not fit this model ({problem}): {hint}")
        if common and not any(k.startswith(common) for k in target):
            raise InputError(f"{key}: '{path}' does not fit this model ({problem}); every key in it starts with "
                             f"'{common}', which no key of this model does, and without that prefix the keys still "
                             "do not fit: is it a checkpoint of another architecture?")
        raise InputError(f"{key}: '{path}' does not fit this model ({problem}); is it a checkpoint of another "
                         "architecture?")
    problem = _value_problem(state, target)
    if problem:
        raise InputError(f"{key}: '{path}' {problem}")
    model.load_state_dict({k: v.to(target[k].dtype) for k, v in state.items()}, strict=True)
    note = f"{key}: loaded {os.path.basename(path)}" + (f" ({entry[0]})" if entry else "")
    if prefix:
        note += f" (the prefix '{prefix}' stripped from its keys)"
    if aux:
        note += f" (its auxiliary classifiers {', '.join(aux)} left out: compress trains without them)"
    if replaced:
        shown = next((k for k in replaced if k.endswith("weight")), next(iter(replaced)))
        note += (f"; its classifier head {shown} {replaced[shown]} was replaced by a new one of shape "
                 f"{tuple(target[shown].shape)} ({NEW_HEAD})")
    elif absent:
        shown = next((k for k in absent if k.endswith("weight")), absent[0])
        note += (f"; it holds no classifier head ({', '.join(absent)}), so a new one of shape "
                 f"{tuple(target[shown].shape)} is {NEW_HEAD}")
    return note


def untrained_head_problem(note, path, num_classes):
    """For a teacher taken as given (teacher.epochs: 0) whose weights file gave it no head for the data's classes
    (`note`: what load_pretrained returned): one sentence saying what head the file has - one for another number
    of classes, or none - and that nothing would train the new one; '' when the file's head is the model's."""
    if NEW_HEAD not in note:
        return ""
    found = _REPLACED_HEAD.search(note)
    advice = "set teacher.epochs to 1 or more (or give weights whose head has these classes)"
    if found:
        return (f"teacher.epochs: 0 takes the teacher as given, but the classifier head in '{path}' is for "
                f"{found.group(1)} classes and the data has {num_classes}: it needs a new head, and with "
                f"teacher.epochs: 0 nothing would train it; {advice}")
    return (f"teacher.epochs: 0 takes the teacher as given, but '{path}' has no classifier head for the data's "
            f"{num_classes} classes, and with teacher.epochs: 0 nothing would train a new one; {advice}")


# ---------------------------------------------------------------- torchvision weights by name

PRETRAINED = "pretrained"  # the model's default torchvision weights (its builder's weights enum's DEFAULT)
TORCHVISION_WEIGHTS = "torchvision:"
OFFLINE_ENV = "COMPRESS_OFFLINE"  # set (to anything but 0): never download weights, only look in the cache


def offline():
    """Whether COMPRESS_OFFLINE forbids downloading weights (set to anything but 0)."""
    return os.environ.get(OFFLINE_ENV, "0") not in ("", "0")


IMAGENET_NORMALISATION = "--set 'data.mean=[0.485, 0.456, 0.406]' --set 'data.std=[0.229, 0.224, 0.225]'"


def normalisation_note(value, data_cfg):
    """For weights torchvision names (`value`: a model.*_weights setting) while the images are normalised with
    their own mean and std (data.mean/std null): the words that say so and how to feed the weights ImageNet's;
    else ''."""
    if not (isinstance(value, str) and is_weights_name(value)) or data_cfg.mean is not None:
        return ""
    return ("; your images are normalised with their own mean and std, not ImageNet's that these weights learned on "
            f"(fine-tuning adapts to that; {IMAGENET_NORMALISATION} feeds them ImageNet's)")


def is_weights_name(value):
    """`pretrained`, `torchvision:<NAME>` (IMAGENET1K_V1, DEFAULT, ...) or `torchvision:<Enum>.<NAME>`: weights
    torchvision names, not a file."""
    return bool(value) and (value == PRETRAINED or value.startswith(TORCHVISION_WEIGHTS))


def _builder_of(model_name):
    """The torchvision builder a model name stands for, or None (a registry model of compress's own, user code)."""
    if model_name.startswith("torchvision:"):
        return model_name.split(":", 1)[1]
    return model_name if model_name in ("resnet18", "mobilenet_v2") else None


def torchvision_weights(value, model_name, key):
    """The torchvision weights enum member `value` names for `model_name`; InputError when it names none."""
    from torchvision.models import get_model_weights, get_weight

    builder = _builder_of(model_name)
    model_key = key.replace("_weights", "")
    if builder is None:
        raise InputError(f"{key}: '{value}' names torchvision weights, but {model_key} is '{model_name}', not a "
                         f"torchvision model; use {model_key}=torchvision:<builder> (e.g. torchvision:resnet18) or "
                         "give a weights file")
    try:
        enum = get_model_weights(builder)
    except (ValueError, KeyError):
        raise InputError(f"{key}: torchvision has no pretrained weights for '{builder}'; give a weights file") \
            from None
    name = "DEFAULT" if value == PRETRAINED else value[len(TORCHVISION_WEIGHTS):]
    if "." in name:  # ResNet18_Weights.IMAGENET1K_V1
        try:
            member = get_weight(name)
        except (ValueError, KeyError, AttributeError):
            member = None
        if member is None or type(member) is not enum:
            raise InputError(f"{key}: '{value}' is not a weights name of torchvision's {builder}; choose one of "
                             f"{', '.join(f'torchvision:{n}' for n in enum.__members__)}")
        return member
    if name not in enum.__members__:
        raise InputError(f"{key}: torchvision's {builder} has no weights '{name}'; choose one of "
                         f"{', '.join(f'torchvision:{n}' for n in enum.__members__)} (or pretrained)")
    return enum[name]


def cache_path(weights):
    """Where torchvision keeps a weights file: $TORCH_HOME/hub/checkpoints/<file name of its URL>."""
    import torch.hub

    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))


_NAME_HASH = re.compile(r"-([a-f0-9]{6,})\.")  # resnet18-f37072fd.pth: the start of the file's sha256


def name_hash(path):
    """The sha256 prefix a torchvision weights file carries in its name ('f37072fd'), or None."""
    found = _NAME_HASH.search(os.path.basename(path))
    return found.group(1) if found else None


_NAME_CHECKED = {}  # file (_identity): whether its sha256 begins with the prefix its name carries
_WARNED = set()  # files (_identity) weights_file has warned about: once per file, not at every look-up


def _identity(path):
    """The file at `path` as it is now: the same key until it is replaced or rewritten."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns


def unpublished(path, checked=None):
    """The sha256 prefix the name of `path` carries when the file's sha256 does not begin with it - not the file
    torchvision publishes under that name (damaged, or another one placed there) - else ''. Hashed once per file
    per process (a weights file is up to hundreds of MB, and a run looks it up several times); `checked`: whether
    it matches, known without hashing (torch has just checked a download)."""
    expected = name_hash(path)
    if not expected:
        return ""
    file = _identity(path)
    if checked is not None:
        _NAME_CHECKED[file] = checked
    if file not in _NAME_CHECKED:
        _NAME_CHECKED[file] = sha256_file(path, follow_links=True, what="weights file").startswith(expected)
    return "" if _NAME_CHECKED[file] else expected


def _warn_if_unpublished(path, key):
    """A warning, not an error, for a file in torch's cache that is not the one torchvision publishes under its
    name: torchvision checks the hash only when it downloads, and a file placed there on purpose (one's own
    weights, a test's) is used as it is."""
    try:
        expected = unpublished(path)
    except (InputError, OSError):  # unreadable, or gone since: the reader says so when the run loads it
        return
    if expected and _identity(path) not in _WARNED:
        _WARNED.add(_identity(path))
        log.warning("%s: '%s' in torch's weights cache is not the file torchvision publishes (its sha256 does not "
                    "begin with %s as its name says), so it is loaded as it is; delete it and rerun to download the "
                    "published weights, unless you placed it there on purpose", key, path, expected)


def weights_file(value, model_name, key, download=False):
    """The file `model.*_weights` stands for: a path as given, or for a torchvision weights name the file in
    torchvision's cache - downloaded there when `download` and the network allow (and COMPRESS_OFFLINE is not
    set), else an InputError naming the file to place and where."""
    if not is_weights_name(value):
        return os.path.expanduser(value)
    weights = torchvision_weights(value, model_name, key)
    path = cache_path(weights)
    if os.path.isfile(path):
        _warn_if_unpublished(path, key)
        return path
    if not download:
        return path
    if not offline():
        import torch.hub

        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # torch checks the sha256 against the prefix in the file name, as torchvision's own loading does
            torch.hub.download_url_to_file(weights.url, path, hash_prefix=name_hash(path), progress=False)
            unpublished(path, checked=True)  # torch has just checked it: not hashed again
            return path
        except Exception as e:  # URLError, timeouts, HTTP errors: no network, or not this address
            why = f"the download failed ({e.__class__.__name__})"
            if isinstance(e, RuntimeError) and "hash" in str(e):
                why = f"the downloaded file's sha256 does not begin with {name_hash(path)} as its name says"
    else:
        why = f"{OFFLINE_ENV} is set"
    raise InputError(f"{key}: torchvision's {weights} is not in torch's cache and {why}; download {weights.url} "
                     f"and place it at {path} (or set TORCH_HOME to the folder whose hub/checkpoints/ holds it)")


def weights_of(model_cfg, role):
    """The weights file `model.<role>_weights` stands for (role: teacher or student), or None when unset."""
    value = getattr(model_cfg, f"{role}_weights")
    return weights_file(value, getattr(model_cfg, role), f"model.{role}_weights") if value else None
