"""Validation shared by the drill's fault descriptions (proxy and store faults).

Fault descriptions arrive from Python, from JSON in an environment variable and from a
file a drill controller rewrites while workers run; each path gets the same checks and
the same :class:`ConfigError` naming the field, so a misspelt fault never turns into a
drill that silently injects nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from .._errors import ConfigError

__all__ = ["check_flag", "check_number", "from_mapping", "to_mapping"]

D = TypeVar("D")


def check_number(setting: str, value: object, *, allow_zero: bool = True) -> float:
    """``value`` as a finite float >= 0 (> 0 unless ``allow_zero``), else ConfigError."""
    # bool is an int: ``true`` in JSON must not read as a latency of one second.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(setting, f"must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(setting, f"must be a finite number {bound}, got {value!r}")
    return number


def check_flag(setting: str, value: object) -> None:
    """Raise ConfigError unless ``value`` is a real bool (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise ConfigError(setting, f"must be true or false, got {value!r}")


def from_mapping(cls: type[D], data: object, where: str) -> D:
    """Build the dataclass ``cls`` from ``data``, refusing unknown keys by name."""
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"must be an object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        raise ConfigError(
            where,
            f"unknown {'key' if len(unknown) == 1 else 'keys'} {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(names))}",
        )
    return cls(**{str(k): v for k, v in data.items()})


def to_mapping(obj: Any) -> dict[str, Any]:
    """The fields of a fault dataclass that differ from their defaults (JSON-ready)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value != f.default:
            out[f.name] = sorted(value) if isinstance(value, frozenset) else value
    return out
