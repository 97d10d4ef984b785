"""Config sections: dataclasses whose fields carry their bounds, built from raw YAML values with every key,
type and bound checked.

Each section belongs to the code that reads it (the loop's `rollverify.rollout.RolloutConfig`, the strategies'
`rollverify.strategies.AlgoConfig`, the trainer wing's `megatron_bridge.config.TrainerConfig`, the
application's own); the application's run config (`rollverify.app.config.RunConfig`) composes them. A field
whose type is a dataclass is a nested section (a mapping in the file, `a.b.c=value` on the command line). A bad
key or value is a `ConfigError` naming the key and what it allows; a section's own cross-field rules are its
`check()`, which raises `ConfigError` too. A section lists the keys it no longer reads in a class attribute
`RETIRED` ({old key: what replaces it}): a file or override that still sets one is refused with that message. A
section that passes keys it does not type on to another program names, in `PASS_THROUGH`, the mapping field that
collects them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import field, fields
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is allowed."""


def bounded(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None, factory=None) -> Any:
    """A dataclass field with numeric bounds checked by `build`."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def check_bound(name: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    """A `bounded` field's value against its bounds (and never NaN); `ConfigError` naming `name`."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if math.isnan(value):
        raise ConfigError(f"{name}: must be a number, got nan")
    for op, bound, ok in (
        (">=", meta.get("ge"), lambda a, b: a >= b),
        (">", meta.get("gt"), lambda a, b: a > b),
        ("<=", meta.get("le"), lambda a, b: a <= b),
        ("<", meta.get("lt"), lambda a, b: a < b),
    ):
        if bound is not None and not ok(value, bound):
            raise ConfigError(f"{name}: must be {op} {bound}, got {value}")


def check_bounds(obj: Any, prefix: str) -> None:
    """Every `bounded` field of the dataclass `obj` within its bounds: what `build` checks, for a section made
    in code."""
    for f in fields(obj):
        check_bound(f"{prefix}.{f.name}", getattr(obj, f.name), f.metadata)


def suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in typing.get_args(tp) else "")
    if origin in (list, tuple):
        return "a list"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number (inf allowed)", str: "a string"}.get(
        tp, str(tp)
    )


def coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` as type `tp`, or a ConfigError naming `key` and what it accepts."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: expected {describe(tp)}, got {value!r}")
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a nested section
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise bad
        return build(tp, value, key)
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise bad
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ConfigError:
                pass
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 and inf as strings
            try:
                return float(value.strip())
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        (elem,) = typing.get_args(tp)[:1] or (Any,)
        return [coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad
        return dict(value)
    raise TypeError(f"config type {tp!r} of {key} is not supported")


def build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """An instance of the dataclass `cls` from `raw`, checking names, types and bounds."""
    hints = typing.get_type_hints(cls)
    flds = {f.name: f for f in fields(cls) if f.init}
    retired: dict[str, str] = getattr(cls, "RETIRED", {})
    pass_through: str | None = getattr(cls, "PASS_THROUGH", None)
    kw: dict[str, Any] = {}
    passed: dict[str, Any] = {}
    for key, value in raw.items():
        if key in retired and key not in flds:
            raise ConfigError(f"{prefix}.{key}: no longer a setting; {retired[key]}")
        if key not in flds and pass_through is not None:
            passed[key] = value
            continue
        if key not in flds:
            names = list(flds)
            raise ConfigError(
                f"unknown config key {prefix}.{key}{suggest(key, names)}; allowed in {prefix}: {', '.join(names)}"
            )
        name = f"{prefix}.{key}"
        v = coerce(value, hints[key], name)
        check_bound(name, v, flds[key].metadata)
        kw[key] = v
    if passed:
        kw[pass_through] = {**kw.get(pass_through, {}), **passed}
    try:
        return cls(**kw)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # AlgoConfig's own checks name the key already
        raise ConfigError(str(e)) from None
