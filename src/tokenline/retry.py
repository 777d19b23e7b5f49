"""Retry delays: capped exponential backoff with full jitter.

The bound for attempt ``n`` (1-based) is ``min(cap, base * 2 ** (n - 1))`` and the delay is
drawn uniformly from ``[0, bound]``, so that many jobs failing together do not come back
together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ._errors import ConfigError
from ._jobs import seconds_problem

__all__ = ["RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long to wait before the next attempt of a transiently failed job."""

    base: float = 1.0
    cap: float = 300.0

    def __post_init__(self) -> None:
        # Durations like an enqueue's delay: numbers, finite, at most MAX_DELAY.
        if (problem := seconds_problem(self.base, zero=False)) is not None:
            raise ConfigError("retry_base", problem)
        if (problem := seconds_problem(self.cap, zero=False)) is not None:
            raise ConfigError("retry_cap", problem)
        if not self.cap >= self.base:
            raise ConfigError("retry_cap", f"must be >= retry_base, got {self.cap!r}")

    def bound(self, attempt: int) -> float:
        """Upper bound of the delay after attempt ``attempt`` (1-based)."""
        if attempt < 1:
            raise ValueError(f"attempt is 1-based, got {attempt}")
        # Cap the exponent first: 2 ** 2000 would overflow a float.
        exp = min(attempt - 1, 64)
        return float(min(self.cap, self.base * (2.0**exp)))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """A full-jitter delay for the retry that follows attempt ``attempt``."""
        return (rng or random).uniform(0.0, self.bound(attempt))
