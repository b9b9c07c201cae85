"""Strict YAML <-> typed dataclass loading.

YAML only serialises: every key must be a field of the target dataclass and
every value must have the field's type, otherwise a ValueError names the key
path and the file the key came from (a base file, or the ``--set`` that set it).
A mapping at any depth may carry ``_base_: other.yaml`` or a list of files
(relative to the including file), loaded first and deep-merged under it: later
bases win over earlier ones, the mapping's own keys over all bases. ``--set
a.b=c`` overrides are applied on top of the merged mapping before type checking.
A section given partially keeps its field's defaults for the keys it omits.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import re
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")
BASE_KEY = "_base_"


class ConfigError(ValueError):
    """A config file or override is invalid; the message says where and how to fix it."""


def load_yaml_tree(path: str | pathlib.Path) -> dict[str, Any]:
    """Read a YAML file into a dict, resolving ``_base_`` includes at any depth."""
    return load_yaml_with_origins(path)[0]


def load_yaml_with_origins(path: str | pathlib.Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Like ``load_yaml_tree``, also returning ``{dotted key path: file that set it last}``.

    Errors about a key then name the file the key came from, not the top-level file
    that included it.
    """
    return _load(pathlib.Path(path).resolve(), ())


def _load(path: pathlib.Path, seen: tuple[pathlib.Path, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    if path in seen:
        chain = " -> ".join(str(p) for p in seen + (path,))
        raise ConfigError(f"{path}: circular {BASE_KEY} include: {chain}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return _resolve_bases(data, path, seen + (path,), "")


def _resolve_bases(node: Any, path: pathlib.Path, seen: tuple[pathlib.Path, ...],
                   prefix: str) -> tuple[Any, dict[str, str]]:
    if not isinstance(node, dict):
        return node, {}
    own: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for key, value in node.items():
        if key == BASE_KEY:
            continue
        own[key], sub_origins = _resolve_bases(value, path, seen, _join(prefix, str(key)))
        origins.update(sub_origins)
        origins[_join(prefix, str(key))] = str(path)
    if BASE_KEY not in node:
        return own, origins
    merged: dict[str, Any] = {}
    merged_origins: dict[str, str] = {}
    for target in _base_paths(node[BASE_KEY], path):
        tree, tree_origins = _load(target, seen)
        merged = deep_merge(merged, tree)
        merged_origins.update({_join(prefix, k): v for k, v in tree_origins.items()})
    merged_origins.update(origins)  # the including file's own keys win
    return deep_merge(merged, own), merged_origins


def _base_paths(base: Any, path: pathlib.Path) -> list[pathlib.Path]:
    bases = base if isinstance(base, list) else [base]
    if not bases or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"{path}: {BASE_KEY} must be a file path or a list of file paths "
                          f"(relative to this file), got {base!r}")
    targets = [(path.parent / b).resolve() for b in bases]
    for b, target in zip(bases, targets):
        if not target.is_file():
            raise ConfigError(f"{path}: {BASE_KEY} {b!r} not found (looked for {target})")
    return targets


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated recursively with ``over`` (neither is modified)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(tree: dict[str, Any], overrides: list[str],
                    origins: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings (values parsed as YAML scalars/lists/mappings).

    ``origins`` (from ``load_yaml_with_origins``), when given, is updated so that
    errors about an overridden key point at the ``--set`` that set it.
    """
    tree = dict(tree)
    for item in overrides:
        key, value = _parse_override(item)
        node = tree
        for part in key[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[key[-1]] = value
        if origins is not None:
            dotted = ".".join(key)
            for k in [k for k in origins if k.startswith(dotted + ".")]:
                del origins[k]
            origins[dotted] = f"--set {item}"
    return tree


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set scheduler.max_staleness=2")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: the key {key.strip()!r} has an empty part; "
                          f"write dotted field names, e.g. --set model.num_layers=4")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: value is not valid YAML: {exc}") from exc
    return parts, value


class Sources:
    """Names the file (or ``--set``) each key path came from, for error messages."""

    def __init__(self, default: str, origins: dict[str, str] | None = None, top: str | None = None):
        self.default, self.origins, self.top = default, origins or {}, top

    def at(self, where: str) -> str:
        """The source of the longest prefix of ``where`` (``a.b[3].c``) with a known origin."""
        key = where
        while key:
            if key in self.origins:
                return self._label(self.origins[key])
            parent = re.sub(r"(\.[^.\[]*|\[\d+\])$", "", key)  # drop the last ".name" or "[i]"
            if parent == key:
                break
            key = parent
        return self.default

    def _label(self, origin: str) -> str:
        if self.top is None or origin == self.top:
            return self.default
        if origin.startswith("--set"):
            return f"{self.default} {origin}"
        return f"{origin} (included from {self.default})"


def from_dict(cls: type[T], data: Any, *, where: str = "", source: str | Sources = "<dict>") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types.

    A nested section given partially keeps the defaults of its parent field (e.g.
    ``critic.optimizer: {weight_decay: 0.1}`` keeps the critic's default lr).
    """
    src = source if isinstance(source, Sources) else Sources(source)
    if not isinstance(data, dict):
        raise ConfigError(f"{src.at(where)}: '{where or '<root>'}': expected a mapping for {cls.__name__}, "
                          f"got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _refuse_moved_keys(cls, data, fields, where, src)
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        path = _join(where, str(unknown[0]))
        close = difflib.get_close_matches(str(unknown[0]), list(fields), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{src.at(path)}: unknown key '{path}'.{hint} Valid keys under "
                          f"'{where or '<root>'}': {', '.join(sorted(fields))}")
    kwargs = {name: _coerce(hints[name], _with_field_default(fields[name], value), _join(where, name), src)
              for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{src.at(where)}: {where or '<root>'}: {exc}") from exc


def _refuse_moved_keys(cls: type, data: dict[str, Any], fields: dict[str, dataclasses.Field], where: str,
                       src: Sources) -> None:
    """A key a class lists in ``MOVED_KEYS`` (an old spelling) is refused with where it lives now: an
    unknown key, or a scalar where a section of the same name now stands (``algorithm.gae: token``). A value
    a class lists in ``MOVED_VALUES`` (``rollout.weight_sync.transport: nccl``) is refused with the name to
    write: the loader is the one place an old spelling is met, and it never rewrites the config."""
    moved = getattr(cls, "MOVED_KEYS", {})
    for key, value in data.items():
        if key in moved and (key not in fields or not isinstance(value, dict)):
            path = _join(where, str(key))
            raise ConfigError(f"{src.at(path)}: '{path}' is an old key: {moved[key]}")
    for key, renamed in getattr(cls, "MOVED_VALUES", {}).items():
        value = data.get(key)
        if isinstance(value, str) and value in renamed:
            path = _join(where, key)
            raise ConfigError(f"{src.at(path)}: '{path}': {value!r} is the old name of {renamed[value]!r}: write "
                              f"{path}: {renamed[value]} (--set {path}={renamed[value]})")


def _with_field_default(f: dataclasses.Field, value: Any) -> Any:
    """Merge a partial mapping over the field's own default (not the nested class's defaults)."""
    if not isinstance(value, dict) or f.default_factory is dataclasses.MISSING:
        return value
    default = f.default_factory()
    return deep_merge(to_dict(default), value) if dataclasses.is_dataclass(default) else value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(tp: Any, value: Any, where: str, src: Sources) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(tp, value, where, src)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where=where, source=src)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or (isinstance(value, bool) and not any(a is value for a in allowed)):
            raise ConfigError(f"{src.at(where)}: '{where}': {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{src.at(where)}: '{where}': expected a list, got {type(value).__name__} {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(item_tp, v, f"{where}[{i}]", src) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{src.at(where)}: '{where}': expected a mapping, "
                              f"got {type(value).__name__} {value!r}")
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {k: _coerce(val_tp, v, f"{where}.{k}", src) for k, v in value.items()}
    return _coerce_scalar(tp, value, where, src)


def _coerce_union(tp: Any, value: Any, where: str, src: Sources) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    if type(value) in args:  # an exact type match wins: "1" stays a str in str | float
        return value
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(arg, value, where, src)
        except ConfigError as exc:
            errors.append(str(exc))
    raise ConfigError(errors[0] if len(errors) == 1 else
                      f"{src.at(where)}: '{where}': {value!r} matches none of {_name(tp)}")


# YAML 1.1 (PyYAML) reads "1e-5" (no dot) as a string; such strings are accepted for floats.
_FLOAT_STR = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _coerce_scalar(tp: Any, value: Any, where: str, src: Sources) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT_STR.match(value.strip()):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{src.at(where)}: '{where}': expected {tp.__name__}, got bool {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{src.at(where)}: '{where}': expected {_name(tp)}, got {type(value).__name__} {value!r}")


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (for writing the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(obj: Any, path: str | pathlib.Path) -> None:
    """Write the resolved config (a dataclass tree) as YAML."""
    pathlib.Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))
