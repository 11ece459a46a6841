"""Checkpoints: safetensors for tensors, JSON for everything else, no pickle anywhere (writes are atomic:
`compress.fileio`).

- `save_weights` / `load_weights`: a stage's final model. Keys never carry `module.` (DDP) or `_orig_mod.`
  (torch.compile): the model is unwrapped once before saving. Metadata names the stage and model so a
  checkpoint of another model is refused with a clear message; loading is strict and names missing,
  unexpected and mismatched keys.
- `save_training_state` / `load_training_state`: everything needed to resume (model incl. training-only
  parts, optimizer tensors, epoch/step, metric history) in ONE file, so a crash can never leave a
  half-updated set of files. Scalars ride along as JSON in the safetensors metadata, and so does the layout
  (name, dtype, shape) of every tensor: `resume_tensors_problem` finds tensors that no longer match it, or that
  hold NaN or infinite values, without the model at hand, so that such a checkpoint starts the stage over.
"""

import hashlib
import json
import math
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from compress.errors import CheckpointError, InputError
from compress.fileio import atomic_write_bytes, dumps, open_regular, read_bytes
from compress.models.weights import and_more, key_mismatch

FORMAT = "compress/1"


def unwrap(model):
    """The plain module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def tensors_of(model):
    """Detached, contiguous CPU clones of the unwrapped model's state: shared storage (tied weights, FX's
    shared fake-quant modules) becomes separate tensors that safetensors accepts."""
    state = unwrap(model).state_dict()
    bad = [k for k in state if k.startswith(("module.", "_orig_mod."))]
    assert not bad, f"wrapper prefixes survived unwrapping: {bad[:3]}"
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def save_weights(path, model, metadata):
    """Save the unwrapped model's weights with string metadata (stage, model, config hash, ...)."""
    meta = {"format": FORMAT, **{k: _meta_str(v) for k, v in metadata.items()}}
    atomic_write_bytes(path, serialize(tensors_of(model), meta))


def serialize(tensors, metadata):
    """safetensors bytes with a canonical header. safetensors writes its JSON header from hash maps, so the
    key order (and the file's sha256) changes from process to process; sorting the header makes identical
    weights give identical files, and the manifest's hashes mean "same content"."""
    data = st_save(tensors, metadata=metadata)
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + size]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format pads the header with spaces to 8-byte alignment
    return len(header).to_bytes(8, "little") + header + data[8 + size:]


def _meta_str(value):
    return value if isinstance(value, str) else dumps(value)


def read_safetensors(path, what="checkpoint", expect_sha256=None):
    """(tensors, metadata) from a safetensors file; a missing, truncated or foreign file is a CheckpointError,
    and so is one whose sha256 differs from `expect_sha256` (the value recorded in the manifest)."""
    try:
        data = read_bytes(path, what)
    except InputError as e:
        raise CheckpointError(str(e)) from None
    try:
        tensors = st_load(data)
        # st_load has validated the layout: 8-byte little-endian header size, then the JSON header
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        metadata = header.get("__metadata__") or {}
    except (SafetensorError, ValueError, OSError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise CheckpointError(f"{what} '{path}' is truncated or not a safetensors file ({reason}); "
                              "rerun the stage that wrote it with --force") from None
    if expect_sha256 is not None and hashlib.sha256(data).hexdigest() != expect_sha256:
        raise CheckpointError(f"'{path}' was modified after it was written (sha256 differs from manifest.json); "
                              "rerun the stage that wrote it with --force")
    return tensors, metadata


def read_metadata(path):
    """Metadata of a safetensors file from its header alone (no tensor data read); JSON values decoded."""
    try:
        with open(open_regular(path, "checkpoint"), "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:
                raise ValueError("bad header size")
            header = json.loads(f.read(size))
        meta = header.get("__metadata__") or {}
    except InputError as e:
        raise CheckpointError(str(e)) from None
    except (OSError, ValueError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"'{path}' is truncated or not a safetensors file ({e.__class__.__name__}); "
                              "delete it, or rerun the stage with --force") from None
    return {k: _decode(v) for k, v in meta.items()}


def read_weights(path, expect_stage=None, expect_model=None, expect_sha256=None):
    """Tensors + metadata of a stage's final weights, verified against the manifest's sha256 and the
    expected stage/model. Metadata values that hold JSON are decoded."""
    tensors, raw_meta = read_safetensors(path, expect_sha256=expect_sha256)
    meta = {k: _decode(v) for k, v in raw_meta.items()}
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' was not written by compress (no '{FORMAT}' metadata); "
                              "use a checkpoint from a compress run directory")
    if expect_stage and meta.get("stage") != expect_stage:
        raise CheckpointError(f"'{path}' holds the output of stage '{meta.get('stage')}', expected '{expect_stage}'")
    if expect_model and meta.get("model") != expect_model:
        raise CheckpointError(f"'{path}' holds a '{meta.get('model')}' model but the config asks for "
                              f"'{expect_model}'; rerun the stage that wrote it or fix model.* in the config")
    return tensors, meta


def _decode(value):
    try:
        return json.loads(value)
    except (ValueError, TypeError, RecursionError):  # not JSON, an integer too long to convert, nested too deep
        return value


def load_into(model, tensors, path):
    """Strict load that explains itself: missing, unexpected, wrong-dtype and wrong-shape keys."""
    target = unwrap(model).state_dict()
    problem = key_mismatch(target, tensors, "wrong dtype", lambda t, v: t.dtype != v.dtype,
                           lambda k, v: f"{k} is {tensors[k].dtype}, expected {v.dtype}")
    if problem:
        raise CheckpointError(f"'{path}' does not fit the model: {problem}")
    try:  # shapes are checked by torch itself: observers legitimately resize their buffers on load
        unwrap(model).load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        detail = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
        raise CheckpointError(f"'{path}' does not fit the model: "
                              f"{'; '.join(detail[:3]) or str(e).splitlines()[0]}") from None


def load_weights(model, path, expect_stage=None, expect_model=None, expect_sha256=None):
    tensors, meta = read_weights(path, expect_stage, expect_model, expect_sha256)
    load_into(model, tensors, path)
    return meta


# ---------------------------------------------------------------- resume state


def save_training_state(path, modules, optimizer, state):
    """One file: `model.<key>` for each module in `modules` (name -> module), `optim.<param>.<name>` for
    optimizer tensors, and `state` (epoch, step, history, ...) as JSON metadata."""
    tensors = {}
    for prefix, module in modules.items():
        tensors.update({f"{prefix}.{k}": v for k, v in tensors_of(module).items()})
    opt = optimizer.state_dict()
    scalars = {}
    for pid, entry in opt["state"].items():
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim.{pid}.{name}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    meta = {"format": FORMAT, "state": dumps(state),
            "optimizer": dumps({"param_groups": opt["param_groups"], "scalars": scalars}),
            "layout": dumps(layout_of(tensors))}
    atomic_write_bytes(path, serialize(tensors, meta))


def layout_of(tensors):
    """{name: [dtype, shape]} of `tensors` (dtype as torch names it, without 'torch.')."""
    return {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()}


def resume_tensors_problem(path, layout):
    """What makes the tensors of the resume checkpoint at `path` unusable, as words that follow "the resume
    checkpoint", or None: tensors that cannot be read; names, dtypes or shapes other than `layout` (its metadata's
    record of what was written; None for a file written before it was recorded: not compared); NaN or infinite
    values in any floating-point tensor, model's or optimizer's; an optimizer record (`optimizer_problem`) that
    `load_training_state` could not restore them with."""
    try:
        tensors, meta = read_safetensors(path, "resume checkpoint")
    except CheckpointError:
        return "is truncated, or its tensors are damaged"
    problem = optimizer_problem(meta.get("optimizer"), tensors)
    if problem:
        return f"is damaged ({problem})"
    if layout is not None:
        if not isinstance(layout, dict):
            return "is damaged (its 'layout' is not a mapping of tensor names to dtype and shape)"
        found = layout_of(tensors)
        problem = key_mismatch(layout, found, "wrong shape or dtype", lambda f, w: f != w,
                               lambda k, w: f"{k} {_shape_dtype(found[k])}, written as {_shape_dtype(w)}")
        if problem:
            return f"does not fit the model it was written for ({problem})"
    bad = [k for k in sorted(tensors) if tensors[k].is_floating_point() and not bool(torch.isfinite(tensors[k]).all())]
    return f"holds NaN or infinite values in {and_more(bad)}" if bad else None


def optimizer_problem(value, tensors):
    """What keeps the optimizer record of a resume checkpoint (its "optimizer" metadata, raw JSON text, and its
    `optim.<param index>.<name>` tensors) from being restored, as words for "is damaged (...)", or None."""
    try:
        record = json.loads(value) if isinstance(value, str) else None
    except (ValueError, RecursionError):  # not JSON, an integer too long to convert, nested too deep
        record = None
    if not isinstance(record, dict):
        return "its 'optimizer' metadata is not JSON"
    groups, scalars = record.get("param_groups"), record.get("scalars")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return "its optimizer's 'param_groups' is not a list of mappings"
    if not isinstance(scalars, dict):
        return "its optimizer's 'scalars' is not a mapping"
    names = list(scalars) + [k.removeprefix("optim.") for k in tensors if k.startswith("optim.")]
    bad = [k for k in names if not (k.partition(".")[0].isascii() and k.partition(".")[0].isdigit()
                                    and k.partition(".")[2])]  # "<param index>.<name>", as torch numbers them
    return f"its optimizer state '{bad[0]}' is not '<parameter index>.<name>'" if bad else None


def _shape_dtype(entry):
    """'(10, 64) float32' for a layout entry [dtype, shape]; the entry as it is when it is not one."""
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list):
        return f"{tuple(entry[1])} {entry[0]}"
    return repr(entry)


def load_training_state(path, modules, optimizer):
    """Restore modules and optimizer in place; return the JSON state (epoch, step, history, ...). Tensors that do
    not fit the modules or the optimizer are a CheckpointError that says how to start the stage over (delete the
    checkpoint's folder, or --force)."""
    tensors, meta = read_safetensors(path, what="resume checkpoint")
    if meta.get("format") != FORMAT or "state" not in meta:
        raise CheckpointError(f"resume checkpoint '{path}' was not written by compress; delete it or use --force")
    start_over = f"delete {os.path.dirname(os.path.abspath(path))}/ (or rerun with --force) to start the stage over"
    # `compress.run.state` starts a checkpoint with a damaged optimizer record over; one damaged since it looked
    # is refused here, before any module is changed
    problem = optimizer_problem(meta.get("optimizer"), tensors)
    if problem:
        raise CheckpointError(f"resume checkpoint '{path}' is damaged ({problem}); {start_over}")
    try:
        for prefix, module in modules.items():
            part = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
            load_into(module, part, path)
    except CheckpointError as e:
        raise CheckpointError(f"resume checkpoint {str(e).rstrip('.')}; {start_over}") from None
    opt_meta = json.loads(meta["optimizer"])
    state = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value
    for key, value in opt_meta["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    # the hyperparameters are the config's (the same config, or the stage would not resume): a value edited in
    # the file (momentum -5) is not taken over; only the state the optimizer accumulated comes from it
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": opt_meta["param_groups"]})
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # torch: "... doesn't match the size of ..."
        raise CheckpointError(f"resume checkpoint '{path}' does not fit the optimizer ({str(e).splitlines()[0]}); "
                              f"{start_over}") from None
    for group, values in zip(optimizer.param_groups, configured):
        group.update(values)
    return _decode(meta["state"])  # not JSON: the raw text, which `validate_resume_state` refuses as no mapping


MAX_COUNT = 10**9  # epochs or steps of an epoch no run reaches


def _finite_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def resume_state_problem(state, epochs=None, steps_per_epoch=None):
    """What is wrong with a resume checkpoint's JSON state (types, ranges), or None."""
    if not isinstance(state, dict):
        return "its state is not a mapping"
    for key in ("epoch", "step"):
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"'{key}' is {value!r}, not a whole number >= 0"
        if value > MAX_COUNT:  # no schedule is that long: known without the data (the plan says it too)
            return f"'{key}' is a {len(str(value))}-digit number, beyond any schedule"
    if epochs is not None and state["epoch"] > epochs:
        return f"'epoch' {state['epoch']} is beyond the configured {epochs} epochs"
    if steps_per_epoch is not None and state["step"] > steps_per_epoch:
        return f"'step' {state['step']} is beyond the {steps_per_epoch} steps of an epoch"
    history = state.get("history", [])
    if not isinstance(history, list) or not all(isinstance(h, dict) and _finite_number(h.get("val_acc"))
                                                for h in history):
        return "'history' is not a list of epoch metrics (each with a finite val_acc)"
    running = state.get("running")
    if running is not None and not (isinstance(running, dict) and {"images", "loss"} <= set(running) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in running.values())):
        return "'running' is not a mapping of numbers (with 'images' and 'loss')"
    for key in ("config_hash",):
        if not isinstance(state.get(key), str):
            return f"'{key}' is missing"
    inputs = state.get("inputs", {})
    if not isinstance(inputs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in inputs.items()):
        return "'inputs' is not a mapping of file names to sha256"
    for key, types, what in (("extra", dict, "a mapping"), ("result_hash", str, "a string"),
                             ("world_size", int, "a whole number")):
        value = state.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            return f"'{key}' is {type(value).__name__}, not {what}"
    if state.get("world_size") is not None and state["world_size"] < 1:
        return f"'world_size' is {state['world_size']}, not a number of processes"
    return None


def validate_resume_state(state, path, epochs=None, steps_per_epoch=None):
    problem = resume_state_problem(state, epochs, steps_per_epoch)
    if problem:
        raise CheckpointError(f"resume checkpoint '{path}' is damaged ({problem}); delete it to start the stage "
                              "over, or rerun with --force")


_NUMPY = {"F16": "float16", "F32": "float32", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64"}


def tensor_sha256(tensor):
    """sha256 of a tensor's bytes (what a chunk's header records for each of its tensors)."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def memory_map_safetensors(path):
    """{tensor name: numpy memmap} of a safetensors file, read-only (the format: 8-byte header size, JSON header,
    then each tensor's bytes at its data_offsets)."""
    import numpy as np

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    base = 8 + size
    maps = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, _ = info["data_offsets"]
        shape, dtype = tuple(info["shape"]), np.dtype(_NUMPY[info["dtype"]])
        maps[name] = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape) \
            if all(shape) else np.zeros(shape, dtype=dtype)
    return maps
