"""A retry budget per queue, in the manner of Finagle's ``RetryBudget``.

Retries are what turns a slow dependency into a dead one: every failed job comes back,
and the load grows just when capacity shrinks. A budget caps them, per queue, to a share
of the work that is new::

    retries in the last `window` seconds  <=  ratio * first attempts in that window
                                              + min_per_second * window

The second term is a small floor, so a quiet queue (a job a minute) can still retry at
all. Call :meth:`RetryBudget.deposit` on each first attempt and
:meth:`RetryBudget.try_spend` before each retry; a refusal is not a failure of the job:
**the worker delays the retry** (re-queues the job further in the future, no attempt
burned) instead of running it at once, and asks again when it comes back.

Defaults: Finagle and Envoy both allow retries of 20% of requests. Finagle keeps them
over 10 s with a floor of 10 retries a second, sized for RPC fan-out; a job worker runs
fewer, longer calls whose retries are already seconds apart, hence a 60 s window and a
floor of one retry every 10 s per queue.

Memory is bounded: each queue keeps at most ``ceil(window / resolution)`` one-second
buckets (60 by default), and at most ``max_queues`` queues are tracked. Beyond that, the
queue used least recently is forgotten; if it comes back it starts again from an empty
window, so it gets the floor and whatever its new first attempts earn. Pure and
clock-injected: every call takes ``now``, a monotonic reading in seconds. Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict

from ._checks import check_fraction, check_int, check_positive
from ._window import SlidingCounts, bucket_span

__all__ = [
    "DEFAULT_MAX_QUEUES",
    "DEFAULT_MIN_PER_SECOND",
    "DEFAULT_RETRY_RATIO",
    "DEFAULT_RETRY_WINDOW",
    "RetryBudget",
]

#: Retries allowed per first attempt (Finagle's ``percentCanRetry``, Envoy's budget).
DEFAULT_RETRY_RATIO = 0.2
#: Seconds over which attempts are counted.
DEFAULT_RETRY_WINDOW = 60.0
#: Retries per second allowed whatever the traffic (one every 10 s).
DEFAULT_MIN_PER_SECOND = 0.1
#: Queues tracked at once; a worker consumes a handful, so this only guards against a
#: caller passing an unbounded set of names.
DEFAULT_MAX_QUEUES = 1_024

_FIRST, _RETRY = 0, 1
# 0.2 * 15 is 3.0000000000000004 but 0.29 * 100 is 28.999999999999996: compare with slack.
_EPSILON = 1e-9


class RetryBudget:
    """At most ``ratio`` retries per first attempt, per queue, over a sliding window."""

    def __init__(
        self,
        *,
        ratio: float = DEFAULT_RETRY_RATIO,
        window: float = DEFAULT_RETRY_WINDOW,
        min_per_second: float = DEFAULT_MIN_PER_SECOND,
        max_queues: int = DEFAULT_MAX_QUEUES,
        resolution: float = 1.0,
    ) -> None:
        """``ratio`` lies in (0, 1]; ``min_per_second`` may be 0 (no floor)."""
        self.ratio = check_fraction("ratio", ratio, closed_top=True)
        self.window = check_positive("window", window)
        self.min_per_second = check_positive("min_per_second", min_per_second, allow_zero=True)
        self.max_queues = check_int("max_queues", max_queues, minimum=1)
        self.resolution = check_positive("resolution", resolution)
        bucket_span(self.window, self.resolution)  # validates their combination
        self._queues: OrderedDict[str, SlidingCounts] = OrderedDict()

    def _counts(self, queue: str) -> SlidingCounts:
        counts = self._queues.get(queue)
        if counts is None:
            counts = SlidingCounts(window=self.window, resolution=self.resolution, fields=2)
            self._queues[queue] = counts
            if len(self._queues) > self.max_queues:
                self._queues.popitem(last=False)
        else:
            self._queues.move_to_end(queue)
        return counts

    def deposit(self, queue: str, now: float) -> None:
        """Record a first attempt on ``queue``: it earns ``ratio`` of a retry."""
        self._counts(queue).add(now, _FIRST)

    def available(self, queue: str, now: float) -> float:
        """Retries ``queue`` may still spend now (may be fractional; never below 0)."""
        counts = self._queues.get(queue)
        first, retries = (0, 0) if counts is None else counts.totals(now)
        allowance = self.ratio * first + self.min_per_second * self.window
        return max(0.0, allowance - retries)

    def try_spend(self, queue: str, now: float) -> bool:
        """Take one retry from ``queue``'s budget; ``False``: delay the retry instead."""
        if self.available(queue, now) + _EPSILON < 1.0:
            return False
        self._counts(queue).add(now, _RETRY)
        return True

    @property
    def queues_tracked(self) -> int:
        """Queues whose counts are held in memory (at most ``max_queues``)."""
        return len(self._queues)

    def describe(self, queue: str, now: float) -> str:
        """``queue``'s state in one line for logs."""
        counts = self._queues.get(queue)
        first, retries = (0, 0) if counts is None else counts.totals(now)
        left = self.available(queue, now)
        # "0.6 left" beside "spent" read as a contradiction: a retry takes a whole one.
        shown = f"{left:.1f} left" if left + _EPSILON >= 1.0 else f"less than one left ({left:.1f})"
        return (
            f"retry budget of {queue!r}: {retries} retries for {first} first attempts "
            f"in {self.window:g}s, {shown} "
            f"(ratio {self.ratio:g}, floor {self.min_per_second:g}/s)"
        )

    def __repr__(self) -> str:
        return (
            f"RetryBudget(ratio={self.ratio!r}, window={self.window!r}, "
            f"min_per_second={self.min_per_second!r}, queues={len(self._queues)})"
        )
