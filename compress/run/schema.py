"""Turn plain YAML data into frozen dataclasses, reporting every problem at once with its key path.

Supported field types: bool, int, float, str, Literal[...], Optional[X], tuple[X, ...], and nested dataclasses.
Sections validate their own values in `__post_init__` by raising ConfigError with keys relative to the
section; `build` prefixes those keys with the section's path and keeps going, so the user sees all problems.
"""

import dataclasses
import difflib
import math
import types
import typing

from compress.errors import ConfigError

MIN_STD = 1e-3  # the smallest per-channel std pixels in 0..1 are divided by (config, channel statistics, ONNX metadata)

_MISSING = object()


def build(cls, raw, path=""):
    """Build `cls` from a mapping; raise ConfigError listing every problem (unknown key, type, range)."""
    problems = []
    value = _build_dataclass(cls, raw, path, problems)
    if problems:
        raise ConfigError(problems)
    return value


def _build_dataclass(cls, raw, path, problems):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{path or 'the config'}: expected a mapping of keys, got {_describe(raw)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{_join(path, close[0])}'?)" if close else f"; valid keys: {', '.join(fields)}"
            problems.append(f"unknown key '{_join(path, key)}'{hint}")
    kwargs = {}
    n_before = len(problems)
    for name, f in fields.items():
        if name not in raw:
            continue
        value = _convert(hints[name], raw[name], _join(path, name), problems)
        if value is not _MISSING:
            kwargs[name] = value
    if len(problems) > n_before:
        return None  # values of this section are broken; range checks would only add noise
    try:
        return cls(**kwargs)
    except ConfigError as e:
        problems.extend(_prefix(path, p) for p in e.problems)
        return None


def _convert(tp, value, path, problems, nullable=False):
    """`value` as type `tp`, or _MISSING with the reason added to `problems`; `nullable`: the key also takes null,
    and a refusal says so."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        built = _build_dataclass(tp, value, path, problems)
        return _MISSING if built is None else built
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path, problems, nullable=True)
    if origin is typing.Literal:
        if value in args:
            return value
        problems.append(f"{path}: must be one of {', '.join(map(str, args))}; got {_describe(value)}")
        return _MISSING
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            hint = f" (a list of one: [{value}])" if isinstance(value, (str, int, float)) and not isinstance(
                value, bool) else ""
            problems.append(_expected(path, "a list", _describe(value), nullable) + hint)
            return _MISSING
        items = [_convert(args[0], v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return _MISSING if _MISSING in items else tuple(items)
    return _scalar(tp, value, path, problems, nullable)


def _expected(path, what, got, nullable):
    return f"{path}: expected {what}{' or null' if nullable else ''}, got {got}"


def _scalar(tp, value, path, problems, nullable):
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(_expected(path, "true or false", _describe(value), nullable))
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) < 2**53:
                return value
            problems.append(f"{path}: {value} is far too large for this setting")
            return _MISSING
        problems.append(_expected(path, "a whole number", _describe(value), nullable))
    elif tp is float:
        number = _MISSING
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e300 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string; accept what float() accepts
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not _MISSING and math.isfinite(number):
            return number
        if number is not _MISSING:  # NaN slips through every `x < 0` check, inf through most: refuse both here
            problems.append(_expected(path, "a finite number", repr(value), nullable))
            return _MISSING
        problems.append(_expected(path, "a number", _describe(value), nullable))
    elif tp is str:
        if isinstance(value, str):
            return value
        problems.append(_expected(path, "a string", _describe(value), nullable))
    else:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"unsupported config field type {tp!r} at {path}")
    return _MISSING


def _describe(value):
    if value is None:
        return "nothing (null)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _join(path, key):
    return f"{path}.{key}" if path else str(key)


def _prefix(path, problem):
    return f"{path}.{problem}" if path else problem


def problems_if(checks):
    """Raise ConfigError with the messages whose condition is true: `problems_if([(x < 0, "x: ...")])`."""
    problems = [msg for bad, msg in checks if bad]
    if problems:
        raise ConfigError(problems)


def to_dict(obj):
    """Dataclass → plain dict (tuples become lists) ready for YAML/JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


_NONE = object()


def get_path(raw, dotted, default=_NONE):
    """`raw["a"]["b"]["c"]` for 'a.b.c' in nested dicts (`default` when a part is missing, else KeyError)."""
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is _NONE:
                raise KeyError(dotted)
            return default
        node = node[part]
    return node


def _annotation(cls, dotted):
    """The annotation 'a.b' names in `cls` (a section's dataclass or a value's type), or None when it names nothing."""
    tp = cls
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp) or part not in {f.name for f in dataclasses.fields(tp)}:
            return None
        tp = typing.get_type_hints(tp)[part]
    return tp


def section_type(cls, dotted):
    """The dataclass of the section 'a.b' names in `cls`, or None when it names a value or nothing."""
    tp = _annotation(cls, dotted)
    return tp if dataclasses.is_dataclass(tp) else None


def value_type(cls, dotted):
    """The annotation of the value 'a.b' names in `cls` (Optional[str], int, ...), or None when it names a section
    or nothing."""
    tp = _annotation(cls, dotted)
    return None if tp is None or dataclasses.is_dataclass(tp) else tp


def takes_text_only(cls, dotted):
    """Whether the value 'a.b' names is text (or null) and nothing else: a path, a name."""
    tp = value_type(cls, dotted)
    return tp is not None and set(typing.get_args(tp) or (tp,)) <= {str, type(None)}


def set_path(raw, dotted, value):
    """Set `a.b.c = value` inside nested dicts, creating mappings on the way."""
    keys = dotted.split(".")
    node = raw
    for key in keys[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[keys[-1]] = value


def reference(cls, path=""):
    """Rows (key, type, default, help) for every leaf field: the config reference in the README."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _join(path, f.name)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(reference(tp, key))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((key, type_name(tp), to_dict(default), f.metadata.get("help", "")))
    return rows


def type_name(tp):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        inner = [type_name(a) for a in args if a is not type(None)]
        return f"{inner[0]} or null"
    if origin is tuple:
        return f"list of {type_name(args[0])}"
    return tp.__name__
