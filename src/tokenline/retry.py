"""Retry delays: capped exponential backoff with full jitter.

The bound for attempt ``n`` (1-based) is ``min(cap, base * 2 ** (n - 1))`` and the delay is
drawn uniformly from ``[0, bound]``, so that many jobs failing together do not come back
together.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from ._errors import ConfigError
from ._jobs import seconds_problem

__all__ = ["RetryPolicy", "policy_delay"]

log = logging.getLogger("tokenline.worker")


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


def policy_delay(policy: RetryPolicy, attempt: int) -> float:
    """``policy``'s delay for the retry after ``attempt``, as the worker asks for it.

    A policy's ``delay`` may be a subclass's, and answer anything: one that raises or
    returns no valid delay (a number of seconds from 0 to ``MAX_DELAY``) is logged as
    an error and the default backoff (``RetryPolicy()``) decides, as the default
    classes do for a classifier that fails. A worker must not fail, nor leave the job
    running, over a bad policy.
    """
    try:
        delay = policy.delay(attempt)
        problem = seconds_problem(delay, zero=True)
    except Exception as exc:
        problem = f"failed: {exc!r}"
        err: BaseException | None = exc
    else:
        if problem is None:
            return float(delay)
        problem = f"returned a delay that {problem}"
        err = None
    log.error(
        "retry policy %r %s (after attempt %d); the default backoff decides",
        *(policy, problem, attempt),
        exc_info=err,
    )
    return RetryPolicy().delay(attempt)
