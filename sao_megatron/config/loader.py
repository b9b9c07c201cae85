"""Strict YAML <-> typed dataclass loading.

YAML only serialises: every key must be a field of the target dataclass and
every value must have the field's type, otherwise a ValueError names the key
path and the file. A mapping may carry ``_base_: other.yaml`` (relative to the
file) which is loaded first and deep-merged under it; ``--set a.b=c``
overrides are applied on top of the merged mapping before type checking.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")
BASE_KEY = "_base_"


class ConfigError(ValueError):
    """A config file or override is invalid; the message says where and how to fix it."""


def load_yaml_tree(path: str | pathlib.Path, _seen: tuple[pathlib.Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML file into a dict, resolving ``_base_`` includes at any depth."""
    path = pathlib.Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: circular {BASE_KEY} include via {[str(p) for p in _seen]}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return _resolve_bases(data, path, _seen + (path,))


def _resolve_bases(node: Any, path: pathlib.Path, seen: tuple[pathlib.Path, ...]) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _resolve_bases(v, path, seen) for k, v in node.items()}
    base = node.pop(BASE_KEY, None)
    if base is None:
        return node
    bases = base if isinstance(base, list) else [base]
    merged: dict[str, Any] = {}
    for b in bases:
        merged = deep_merge(merged, load_yaml_tree(path.parent / b, seen))
    return deep_merge(merged, node)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated recursively with ``over`` (neither is modified)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings (values parsed as YAML scalars/lists)."""
    tree = dict(tree)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set scheduler.max_staleness=2")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: value is not valid YAML: {exc}") from exc
        parts = key.strip().split(".")
        node = tree
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return tree


def from_dict(cls: type[T], data: Any, *, where: str = "", source: str = "<dict>") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where or '<root>'}: expected a mapping for {cls.__name__}, "
                          f"got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        path = _join(where, unknown[0])
        raise ConfigError(f"{source}: unknown key '{path}'. Valid keys under '{where or '<root>'}': "
                          f"{', '.join(sorted(fields))}")
    kwargs = {name: _coerce(hints[name], value, _join(where, name), source)
              for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{source}: {where or '<root>'}: {exc}") from exc


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(tp: Any, value: Any, where: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{source}: '{where}': {value!r} matches none of {_name(tp)}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where=where, source=source)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{source}: '{where}': {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: '{where}': expected a list, got {type(value).__name__} {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(item_tp, v, f"{where}[{i}]", source) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{where}': expected a mapping, got {type(value).__name__}")
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {k: _coerce(val_tp, v, f"{where}.{k}", source) for k, v in value.items()}
    return _coerce_scalar(tp, value, where, source)


def _coerce_scalar(tp: Any, value: Any, where: str, source: str) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-5" as a string; accept plain numeric strings for floats
            return float(value)
        except ValueError:
            pass
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{source}: '{where}': expected {tp.__name__}, got bool {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{source}: '{where}': expected {_name(tp)}, got {type(value).__name__} {value!r}")


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
