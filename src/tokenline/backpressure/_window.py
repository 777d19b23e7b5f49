"""Counts over a sliding time window, kept in fixed-width buckets.

Time is cut into buckets ``resolution`` seconds wide; a bucket is the integer
``floor(now / resolution)``. The window holds the last ``span = ceil(window / resolution)``
buckets, the current one included, so it covers between ``window - resolution`` and
``window`` seconds of the past. Only non-empty buckets are stored, oldest first, and a
bucket is dropped as soon as it leaves the window: memory never exceeds ``span`` buckets of
``fields`` integers, whatever the traffic.

Readings should come from a monotonic clock. One that goes backwards (two threads reading
it, a caller passing a stale ``now``) is counted in the newest bucket rather than
rewriting the past.
"""

from __future__ import annotations

import math
from collections import deque

from .._errors import ConfigError
from ._checks import check_now, check_positive

__all__ = ["MAX_BUCKETS", "SlidingCounts", "bucket_span"]

#: Most buckets one window may hold (a day at one-second resolution would be 86,400):
#: a guard against a window and resolution that make memory grow without saying so.
MAX_BUCKETS = 3_600


def bucket_span(window: float, resolution: float) -> int:
    """Number of buckets a window needs; :class:`ConfigError` when it is too many."""
    check_positive("window", window)
    check_positive("resolution", resolution)
    if resolution > window:
        raise ConfigError("resolution", f"must be <= window ({window!r}), got {resolution!r}")
    span = math.ceil(window / resolution)
    if span > MAX_BUCKETS:
        raise ConfigError(
            "resolution",
            f"window / resolution is {span} buckets, more than {MAX_BUCKETS}: "
            "use a coarser resolution",
        )
    return span


class SlidingCounts:
    """``fields`` counters summed over the last ``window`` seconds."""

    __slots__ = ("_buckets", "_resolution", "_span", "_totals")

    def __init__(self, *, window: float, resolution: float, fields: int) -> None:
        self._span = bucket_span(window, resolution)
        self._resolution = float(resolution)
        # Each entry is [bucket index, count of field 0, count of field 1, ...].
        self._buckets: deque[list[int]] = deque()
        self._totals = [0] * fields

    def _index(self, now: float) -> int:
        index = math.floor(check_now(now) / self._resolution)
        if self._buckets and index < self._buckets[-1][0]:
            index = self._buckets[-1][0]
        return index

    def _expire(self, index: int) -> None:
        oldest_kept = index - self._span + 1
        while self._buckets and self._buckets[0][0] < oldest_kept:
            dropped = self._buckets.popleft()
            for field, count in enumerate(dropped[1:]):
                self._totals[field] -= count

    def add(self, now: float, field: int, amount: int = 1) -> None:
        """Count ``amount`` events of ``field`` at time ``now``."""
        index = self._index(now)
        self._expire(index)
        if not self._buckets or self._buckets[-1][0] != index:
            self._buckets.append([index] + [0] * len(self._totals))
        self._buckets[-1][field + 1] += amount
        self._totals[field] += amount

    def totals(self, now: float) -> tuple[int, ...]:
        """Each field's count over the window that ends at ``now``."""
        self._expire(self._index(now))
        return tuple(self._totals)

    def is_empty(self, now: float) -> bool:
        """Whether nothing was counted within the window that ends at ``now``."""
        self._expire(self._index(now))
        return not self._buckets

    @property
    def stored_buckets(self) -> int:
        """Buckets held in memory right now (at most the window's span)."""
        return len(self._buckets)
