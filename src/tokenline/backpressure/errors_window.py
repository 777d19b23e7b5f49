"""The error rate of recent jobs, to pause consumption when too many fail.

:class:`ErrorRateWindow` counts outcomes over a sliding window of ``window`` seconds and
says when the share of failures reaches ``threshold`` with at least ``min_calls``
outcomes to go on (a single failure on a quiet worker is not a 100% error rate worth
acting on). The worker then stops claiming for a while, instead of pulling jobs only to
fail them and burn their attempts.

Record what says something about the worker's surroundings: a success as ``ok=True``,
a timeout, transient or coordination failure as ``ok=False``. A permanent failure is the
job's own fault; counting it would pause the whole worker because of a batch of bad
jobs, so record it as ``ok=True`` or not at all (see
:attr:`~tokenline.backpressure.FailureKind.is_overload`).

Defaults come from resilience4j's circuit breaker (open at 50% failures) and Polly v8
(30 s sampling window). Both want 100 calls first; a worker of ten slots running
multi-second jobs may not finish 100 in 30 s, so 20 here.

Memory is bounded: at most ``ceil(window / resolution)`` buckets of two counters. Pure
and clock-injected: every call takes ``now``, a monotonic reading in seconds.
Not thread-safe.
"""

from __future__ import annotations

from ._checks import check_fraction, check_int, check_positive
from ._window import SlidingCounts

__all__ = [
    "DEFAULT_ERROR_THRESHOLD",
    "DEFAULT_ERROR_WINDOW",
    "DEFAULT_MIN_CALLS",
    "ErrorRateWindow",
]

#: Seconds of outcomes considered (Polly v8's sampling duration).
DEFAULT_ERROR_WINDOW = 30.0
#: Share of failures that trips the window (resilience4j's failure-rate threshold).
DEFAULT_ERROR_THRESHOLD = 0.5
#: Outcomes needed within the window before the rate is acted on.
DEFAULT_MIN_CALLS = 20

_OK, _FAILED = 0, 1


class ErrorRateWindow:
    """Share of failed outcomes over the last ``window`` seconds."""

    def __init__(
        self,
        *,
        window: float = DEFAULT_ERROR_WINDOW,
        threshold: float = DEFAULT_ERROR_THRESHOLD,
        min_calls: int = DEFAULT_MIN_CALLS,
        resolution: float = 1.0,
    ) -> None:
        """``threshold`` lies in (0, 1]; ``min_calls`` is at least 1."""
        self.window = check_positive("window", window)
        self.threshold = check_fraction("threshold", threshold, closed_top=True)
        self.min_calls = check_int("min_calls", min_calls, minimum=1)
        self.resolution = check_positive("resolution", resolution)
        self._counts = SlidingCounts(window=self.window, resolution=self.resolution, fields=2)

    def record(self, ok: bool, now: float) -> None:
        """Count one outcome at ``now``: ``ok`` for a success."""
        self._counts.add(now, _OK if ok else _FAILED)

    def count(self, now: float) -> int:
        """Outcomes within the window that ends at ``now``."""
        ok, failed = self._counts.totals(now)
        return ok + failed

    def failures(self, now: float) -> int:
        """Failed outcomes within the window that ends at ``now``."""
        return self._counts.totals(now)[_FAILED]

    def rate(self, now: float) -> float:
        """Share of failures within the window, in [0, 1]; 0 when it is empty."""
        ok, failed = self._counts.totals(now)
        total = ok + failed
        return failed / total if total else 0.0

    def exceeded(self, now: float) -> bool:
        """Whether to pause: ``min_calls`` outcomes or more, and the rate at ``threshold``."""
        return self.count(now) >= self.min_calls and self.rate(now) >= self.threshold

    def describe(self, now: float) -> str:
        """The state in one line for logs."""
        return (
            f"error rate {self.rate(now):.0%} of {self.count(now)} in {self.window:g}s "
            f"(pause at {self.threshold:.0%} with {self.min_calls} or more)"
        )

    def __repr__(self) -> str:
        return (
            f"ErrorRateWindow(window={self.window!r}, threshold={self.threshold!r}, "
            f"min_calls={self.min_calls!r})"
        )
