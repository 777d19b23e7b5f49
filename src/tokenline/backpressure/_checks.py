"""Parameter checks shared by the backpressure pieces.

Each check raises :class:`~tokenline.ConfigError` naming the parameter, so a bad value in
a worker's settings is reported by the name the operator typed, at start-up.
"""

from __future__ import annotations

import math

from .._errors import ConfigError

__all__ = [
    "check_fraction",
    "check_int",
    "check_now",
    "check_positive",
]


def _number(name: str, value: object) -> float:
    # bool is an int subclass: True as a ratio is a typo, not a number.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")
    return float(value)


def check_positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    """``value`` as a float if it is finite and > 0 (or >= 0 with ``allow_zero``)."""
    number = _number(name, value)
    if number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(name, f"must be {bound}, got {value!r}")
    return number


def check_fraction(name: str, value: object, *, closed_top: bool = False) -> float:
    """``value`` as a float if it lies in (0, 1), or in (0, 1] with ``closed_top``."""
    number = _number(name, value)
    if number <= 0 or number > 1 or (number == 1 and not closed_top):
        interval = "(0, 1]" if closed_top else "(0, 1), both ends excluded"
        raise ConfigError(name, f"must lie in {interval}, got {value!r}")
    return number


def check_int(name: str, value: object, *, minimum: int) -> int:
    """``value`` if it is a whole number >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"must be a whole number >= {minimum}, got {value!r}")
    return value


def check_now(now: float) -> float:
    """``now`` if it is a finite reading of a clock (a bug in the caller otherwise)."""
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise ValueError(f"now must be a finite clock reading in seconds, got {now!r}")
    return float(now)
