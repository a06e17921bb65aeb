"""YAML + key=value overrides -> a frozen dataclass, validated once at the edge.

Every stage declares its config as a frozen dataclass (fields with defaults and type
hints). `load_config(Cls, path, ["key=value", ...])` reads the YAML, applies the overrides,
rejects unknown keys and values of the wrong type with a message naming the key, and
returns an instance. The core never sees dicts or environment variables.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config: unknown key, wrong type, missing file. The message names the key."""


def parse_override(item: str) -> tuple[str, Any]:
    """'key=value' -> (key, YAML-parsed value): 'lr=0.001' -> 0.001, 'ids=[1,2]' -> [1, 2].

    YAML 1.1 reads '3e-4' (no dot) as a string; float fields accept it (see `_coerce`)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against a type hint; allow the harmless widenings (int -> float, list -> tuple)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin in (list, tuple) or hint in (list, tuple):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and origin is not None:
            value = [value] if not isinstance(value, str) else value
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        elem = args[0] if args else Any
        items = [_coerce(f"{key}[{i}]", v, elem) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if hint is Path:
        return Path(str(value))
    return value


def build_config(cls: type[T], values: dict[str, Any], source: str = "config") -> T:
    """Validate a dict against dataclass `cls`; unknown keys and wrong types raise ConfigError."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a mapping of keys to values")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown} for {cls.__name__}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {missing}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from e


def read_yaml_mapping(path: str | Path) -> dict:
    """A YAML file whose top level is a mapping; ConfigError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return loaded


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Read YAML at `path` (optional), apply key=value `overrides`, validate into `cls`.

    A YAML file may carry a top-level `stage: <name>`; if the class declares `STAGE` and the
    names differ, the file is refused (a train config passed to distill is an error).
    """
    values: dict[str, Any] = {}
    source = "overrides"
    if path is not None:
        path = Path(path)
        loaded = read_yaml_mapping(path)
        stage = loaded.pop("stage", None)
        expected = getattr(cls, "STAGE", None)
        if stage is not None and expected is not None and stage != expected:
            raise ConfigError(f"{path} is a config for stage '{stage}', not '{expected}'")
        values.update(loaded)
        source = str(path)
    for item in overrides:
        key, value = parse_override(item)
        values[key] = value
    return build_config(cls, values, source)


def config_to_dict(cfg) -> dict:
    """JSON-friendly dict of a config dataclass (Paths as strings, tuples as lists)."""
    def conv(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return {k: conv(v) for k, v in dataclasses.asdict(cfg).items()}
