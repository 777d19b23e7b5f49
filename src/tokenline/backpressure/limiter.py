"""Adaptive concurrency: how many jobs a worker should run at once, learnt from outcomes.

A limiter holds a ``limit`` between a ``floor`` and a ``ceiling`` (the worker's configured
concurrency). The worker reports every finished job: :meth:`~ConcurrencyLimiter.on_success`
with its latency, :meth:`~ConcurrencyLimiter.on_failure` with a :class:`FailureKind`; and
asks :meth:`~ConcurrencyLimiter.claim_batch` how many jobs it may claim now. Two variants
share that interface, after Netflix's concurrency-limits library:

* :class:`AIMDLimiter` (additive increase, multiplicative decrease, as TCP congestion
  avoidance): +1 after a streak of fast successes, ``* factor`` on an overload failure.
* :class:`GradientLimiter` (Netflix's Gradient2): compares a long-term latency average
  with a short-term one; when jobs get slower than usual, the limit falls in proportion::

      gradient  = clamp(tolerance * long_rtt / short_rtt, min_gradient, 1)
      new_limit = limit * gradient + queue_allowance
      limit     = clamp(limit * (1 - smoothing) + new_limit * smoothing, floor, ceiling)

Which failures shrink the limit
-------------------------------

Timeouts, transient errors and coordination errors (the store) are signs of overload, and
shrink the limit. A **permanent** error is the job's own fault (bad arguments, a bug, a
``Permanent`` raised by the handler): running fewer jobs at once would not help, so it
never shrinks the limit (``decrease_on`` refuses to list it).

One burst, one decrease
-----------------------

When a dependency dies, every slot fails at about the same moment. Those failures are one
piece of evidence, so a limiter decreases at most once per ``cooldown`` seconds, and
ignores the failure of a job that *started* before the last decrease (it was admitted
under the old, larger limit: the decrease has already answered it, as TCP answers one
loss per window). Pass ``started`` to :meth:`~ConcurrencyLimiter.on_failure` to get the
second rule; the first needs nothing.

Wiring into a worker
--------------------

All calls are synchronous and cheap; a limiter is not thread-safe, so call it from the
worker's event loop only. Time comes from the injected :class:`~tokenline.Clock`'s
``monotonic()``::

    limiter = AIMDLimiter(ceiling=settings.concurrency, clock=clock)
    # fetch loop
    n = limiter.claim_batch(settings.concurrency - len(slots), in_flight=len(slots))
    # a job finished (in_flight: jobs running at that moment, this one included)
    limiter.on_success(clock.monotonic() - slot.started, in_flight=len(slots))
    limiter.on_failure(FailureKind.TIMEOUT, started=slot.started)        # hard timeout
    limiter.on_failure(FailureKind.from_error_class(decision.error_class),
                       started=slot.started)
    log.info("concurrency %s", limiter.describe())

``in_flight`` is optional: given, the limit does not grow while the worker uses less than
half of it (an idle worker has proved nothing about a larger limit; Netflix's rule).
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from .._clock import Clock, SystemClock
from .._errors import ConfigError
from ..classify import ErrorClass
from ._checks import check_fraction, check_int, check_positive

if TYPE_CHECKING:
    from .._config import WorkerSettings

__all__ = [
    "DEFAULT_CEILING",
    "DEFAULT_COOLDOWN",
    "DEFAULT_FLOOR",
    "OVERLOAD_KINDS",
    "AIMDLimiter",
    "ConcurrencyLimiter",
    "FailureKind",
    "GradientLimiter",
]

#: Lowest limit: a worker under overload still runs one job, so it notices recovery.
DEFAULT_FLOOR = 1
#: Highest limit: ``WorkerSettings.concurrency``'s default; a worker passes its own.
DEFAULT_CEILING = 10
#: Seconds after a decrease during which further failures do not decrease again: the
#: failures of one outage reach every slot within about a second.
DEFAULT_COOLDOWN = 1.0

#: AIMD's decrease factor: TCP Reno halves its window once per loss event (RFC 5681).
#: Netflix's AIMDLimit uses 0.9, but applies it on every single drop; with the cool-down
#: a burst counts once, so the once-per-event factor is the fitting one.
DEFAULT_AIMD_FACTOR = 0.5

#: Gradient2's defaults (Netflix concurrency-limits): tolerance of the latency ratio,
#: smoothing of the limit, and the long-term average taken over 600 samples.
DEFAULT_TOLERANCE = 1.5
DEFAULT_SMOOTHING = 0.2
DEFAULT_LONG_WINDOW = 600
#: Gradient2 compares with the latest sample alone; job latencies vary far more than an
#: RPC's, so the short-term side is averaged over a few samples (1 gives Gradient2 back).
DEFAULT_SHORT_WINDOW = 10
#: Gradient2 never lets one update cut the limit by more than half.
DEFAULT_MIN_GRADIENT = 0.5
#: Decrease factor of the gradient limiter on an overload failure: Netflix AIMDLimit's
#: backoff ratio; latency already pulls this limiter down, failures only add to it.
DEFAULT_GRADIENT_FACTOR = 0.9

# A job can finish within one tick of a coarse clock; a zero latency would divide by zero.
_MIN_LATENCY = 1e-6
# Gradient2: once latency is back to normal after a long overload, the long-term average
# is far above the short-term one; shrink it faster than its smoothing would.
_RECOVERY_RATIO = 2.0
_RECOVERY_DECAY = 0.95


class FailureKind(enum.StrEnum):
    """Why a job failed, as far as concurrency is concerned."""

    #: The attempt ran past its hard time limit.
    TIMEOUT = "timeout"
    #: A transient error: a dependency refused, reset or was unreachable.
    TRANSIENT = "transient"
    #: The store (leases, ledger) failed or was unreachable.
    COORDINATION = "coordination"
    #: The job's own fault: it would fail the same way under any load.
    PERMANENT = "permanent"

    @property
    def is_overload(self) -> bool:
        """Whether this kind of failure may mean the worker is doing too much at once."""
        return self is not FailureKind.PERMANENT

    @classmethod
    def from_error_class(cls, error_class: ErrorClass) -> FailureKind:
        """The kind matching a :func:`~tokenline.classify` verdict (timeouts aside)."""
        return cls(ErrorClass(error_class).value)


#: Failures that shrink the limit by default: every kind but PERMANENT.
OVERLOAD_KINDS = frozenset(kind for kind in FailureKind if kind.is_overload)


def _check_latency(latency: float) -> float:
    if isinstance(latency, bool) or not isinstance(latency, int | float):
        raise TypeError(f"latency must be a number of seconds, got {latency!r}")
    if not (math.isfinite(latency) and latency >= 0):
        raise ValueError(f"latency must be a finite number of seconds >= 0, got {latency!r}")
    return max(float(latency), _MIN_LATENCY)


def _check_decrease_on(kinds: Iterable[FailureKind]) -> frozenset[FailureKind]:
    try:
        checked = frozenset(FailureKind(kind) for kind in kinds)
    except (TypeError, ValueError):
        names = ", ".join(k.value for k in FailureKind)
        raise ConfigError("decrease_on", f"must name failure kinds among {names}") from None
    if FailureKind.PERMANENT in checked:
        raise ConfigError(
            "decrease_on",
            "permanent failures are the job's fault, not overload: they cannot shrink the limit",
        )
    return checked


class ConcurrencyLimiter(ABC):
    """A concurrency limit between ``floor`` and ``ceiling``, adapted to job outcomes.

    Subclasses decide how successes grow the limit and how an overload failure shrinks
    it; the cool-down, the choice of failures that count and :meth:`claim_batch` are
    shared.
    """

    #: Short name of the algorithm, shown by :meth:`describe`.
    algorithm: ClassVar[str]

    def __init__(
        self,
        *,
        floor: int,
        ceiling: int,
        initial: int | None,
        cooldown: float,
        decrease_on: Iterable[FailureKind],
        clock: Clock | None,
    ) -> None:
        self.floor = check_int("floor", floor, minimum=1)
        self.ceiling = check_int("ceiling", ceiling, minimum=1)
        if floor > ceiling:
            raise ConfigError("floor", f"must be <= ceiling ({ceiling}), got {floor}")
        start = ceiling if initial is None else check_int("initial", initial, minimum=1)
        if not floor <= start <= ceiling:
            raise ConfigError(
                "initial", f"must lie between floor ({floor}) and ceiling ({ceiling}), got {start}"
            )
        self._initial = start
        self.cooldown = check_positive("cooldown", cooldown, allow_zero=True)
        self.decrease_on = _check_decrease_on(decrease_on)
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._last_decrease: float | None = None

    @property
    @abstractmethod
    def limit(self) -> int:
        """How many jobs may run at once now, in ``[floor, ceiling]``."""

    @abstractmethod
    def on_success(self, latency: float, *, in_flight: int | None = None) -> None:
        """A job succeeded after ``latency`` seconds, with ``in_flight`` jobs running."""

    @abstractmethod
    def _decrease(self) -> None:
        """Shrink the limit after an overload failure the cool-down lets through."""

    def on_failure(self, kind: FailureKind, *, started: float | None = None) -> None:
        """A job failed with ``kind``; ``started`` is its start on the clock's monotonic time.

        Shrinks the limit if ``kind`` is in ``decrease_on``, unless a decrease happened
        less than ``cooldown`` seconds ago or after the job started.
        """
        if FailureKind(kind) not in self.decrease_on:
            return
        now = self._clock.monotonic()
        last = self._last_decrease
        if last is not None:
            if now - last < self.cooldown:
                return
            if started is not None and started < last:
                return
        self._decrease()
        self._last_decrease = now

    def claim_batch(self, free: int, *, in_flight: int) -> int:
        """How many jobs to claim now: never more than ``free`` slots, nor past the limit.

        ``free`` is what the worker's pool has room for; ``in_flight`` the jobs it runs.
        """
        return max(0, min(free, self.limit - in_flight))

    def _details(self) -> str:
        return ""

    def describe(self) -> str:
        """The state in one line for logs: ``limit 12 (floor 1, ceiling 50), AIMD``."""
        text = f"limit {self.limit} (floor {self.floor}, ceiling {self.ceiling}), {self.algorithm}"
        if self._last_decrease is not None:
            ago = self._clock.monotonic() - self._last_decrease
            text += f", last decrease {ago:.1f}s ago"
        return text + self._details()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(limit={self.limit}, floor={self.floor}, ceiling={self.ceiling})"
        )


class AIMDLimiter(ConcurrencyLimiter):
    """Additive increase, multiplicative decrease.

    * **Increase**: +1 after ``increase_after`` successes in a row (default: as many as
      the current limit, one round of full slots, like TCP's one segment per round trip),
      up to ``ceiling``. A success slower than ``slow_latency`` (when given) or an overload
      failure restarts the streak; a success while less than half the limit is in use
      neither counts nor restarts it.
    * **Decrease**: ``limit * factor`` (rounded down, not below ``floor``) on an overload
      failure, once per burst (see the module docstring).
    """

    algorithm = "AIMD"

    def __init__(
        self,
        *,
        floor: int = DEFAULT_FLOOR,
        ceiling: int = DEFAULT_CEILING,
        initial: int | None = None,
        factor: float = DEFAULT_AIMD_FACTOR,
        increase_after: int | None = None,
        slow_latency: float | None = None,
        cooldown: float = DEFAULT_COOLDOWN,
        decrease_on: Iterable[FailureKind] = OVERLOAD_KINDS,
        clock: Clock | None = None,
    ) -> None:
        """``initial`` defaults to ``ceiling``: the configured concurrency is the
        operator's estimate of capacity, so a fresh worker starts there and sheds load
        on evidence, rather than crawling up from the floor after every restart."""
        super().__init__(
            floor=floor,
            ceiling=ceiling,
            initial=initial,
            cooldown=cooldown,
            decrease_on=decrease_on,
            clock=clock,
        )
        self.factor = check_fraction("factor", factor)
        if increase_after is not None:
            check_int("increase_after", increase_after, minimum=1)
        self.increase_after = increase_after
        self.slow_latency = (
            None if slow_latency is None else check_positive("slow_latency", slow_latency)
        )
        self._limit = self._initial
        self._streak = 0

    @property
    def limit(self) -> int:
        """How many jobs may run at once now, in ``[floor, ceiling]``."""
        return self._limit

    def on_success(self, latency: float, *, in_flight: int | None = None) -> None:
        """Count a success towards the next +1, unless slow or while the worker idles."""
        latency = _check_latency(latency)
        if self.slow_latency is not None and latency > self.slow_latency:
            self._streak = 0
            return
        if in_flight is not None and in_flight < self._limit / 2:
            return
        self._streak += 1
        if self._streak >= (self.increase_after or self._limit):
            self._streak = 0
            self._limit = min(self.ceiling, self._limit + 1)

    def on_failure(self, kind: FailureKind, *, started: float | None = None) -> None:
        """As :meth:`ConcurrencyLimiter.on_failure`; an overload failure also restarts
        the streak of successes, decreased on or not."""
        if FailureKind(kind) in self.decrease_on:
            self._streak = 0
        super().on_failure(kind, started=started)

    def _decrease(self) -> None:
        self._limit = max(self.floor, int(self._limit * self.factor))


class _Ema:
    """Exponential moving average over about ``window`` samples.

    Until ``window`` samples are in, it is their plain mean, so the first sample does not
    weigh as much as the whole window (a warm-up, as Netflix's ``ExpAvgMeasurement``).
    """

    __slots__ = ("_alpha", "_count", "_window", "value")

    def __init__(self, window: int) -> None:
        self._alpha = 2.0 / (window + 1)
        self._window = window
        self._count = 0
        self.value = 0.0

    def add(self, sample: float) -> float:
        if self._count < self._window:
            self._count += 1
        self.value += max(self._alpha, 1.0 / self._count) * (sample - self.value)
        return self.value


class GradientLimiter(ConcurrencyLimiter):
    """Netflix Gradient2: the limit follows the ratio of long-term to short-term latency.

    While jobs take about as long as usual (``short_rtt <= tolerance * long_rtt``) the
    gradient is 1 and the limit grows by ``queue_allowance`` (smoothed); when they get
    slower, it falls in proportion, by at most ``1 - min_gradient`` per update. The
    long-term average slowly adopts a new normal, so a lasting change of workload is not
    mistaken for overload forever. An overload failure also multiplies the limit by
    ``factor``, once per burst.

    ``queue_allowance`` defaults to √limit. Netflix's GradientLimit uses max(4, √limit)
    for limits of 20 to 200; for a job worker's small limits a constant 4 would hold the
    limit above 8 however slow the jobs get.
    """

    algorithm = "gradient"

    def __init__(
        self,
        *,
        floor: int = DEFAULT_FLOOR,
        ceiling: int = DEFAULT_CEILING,
        initial: int | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
        smoothing: float = DEFAULT_SMOOTHING,
        long_window: int = DEFAULT_LONG_WINDOW,
        short_window: int = DEFAULT_SHORT_WINDOW,
        min_gradient: float = DEFAULT_MIN_GRADIENT,
        queue_allowance: float | None = None,
        factor: float = DEFAULT_GRADIENT_FACTOR,
        cooldown: float = DEFAULT_COOLDOWN,
        decrease_on: Iterable[FailureKind] = OVERLOAD_KINDS,
        clock: Clock | None = None,
    ) -> None:
        """``initial`` defaults to ``ceiling``, as for :class:`AIMDLimiter`."""
        super().__init__(
            floor=floor,
            ceiling=ceiling,
            initial=initial,
            cooldown=cooldown,
            decrease_on=decrease_on,
            clock=clock,
        )
        self.tolerance = check_positive("tolerance", tolerance)
        if self.tolerance < 1:
            raise ConfigError(
                "tolerance",
                f"must be >= 1 (below 1 even steady latency shrinks the limit), got {tolerance!r}",
            )
        self.smoothing = check_fraction("smoothing", smoothing, closed_top=True)
        self.long_window = check_int("long_window", long_window, minimum=2)
        self.short_window = check_int("short_window", short_window, minimum=1)
        if short_window >= long_window:
            raise ConfigError(
                "short_window", f"must be < long_window ({long_window}), got {short_window}"
            )
        self.min_gradient = check_fraction("min_gradient", min_gradient, closed_top=True)
        self.queue_allowance = (
            None
            if queue_allowance is None
            else check_positive("queue_allowance", queue_allowance, allow_zero=True)
        )
        self.factor = check_fraction("factor", factor)
        self._estimate = float(self._initial)
        self._long = _Ema(long_window)
        self._short = _Ema(short_window)

    @property
    def limit(self) -> int:
        """How many jobs may run at once now, in ``[floor, ceiling]``."""
        return int(self._estimate)

    @property
    def long_rtt(self) -> float:
        """The long-term latency average in seconds (0 before the first success)."""
        return self._long.value

    @property
    def short_rtt(self) -> float:
        """The short-term latency average in seconds (0 before the first success)."""
        return self._short.value

    def _clamp(self, value: float) -> float:
        return min(float(self.ceiling), max(float(self.floor), value))

    def on_success(self, latency: float, *, in_flight: int | None = None) -> None:
        """Feed a latency sample; update the limit unless less than half of it is in use."""
        latency = _check_latency(latency)
        short = self._short.add(latency)
        long = self._long.add(latency)
        if long / short > _RECOVERY_RATIO:
            self._long.value *= _RECOVERY_DECAY
            long = self._long.value
        if in_flight is not None and in_flight < self._estimate / 2:
            return
        gradient = max(self.min_gradient, min(1.0, self.tolerance * long / short))
        allowance = (
            math.sqrt(self._estimate) if self.queue_allowance is None else self.queue_allowance
        )
        target = self._estimate * gradient + allowance
        self._estimate = self._clamp(
            self._estimate * (1 - self.smoothing) + target * self.smoothing
        )

    def _decrease(self) -> None:
        self._estimate = self._clamp(self._estimate * self.factor)

    def _details(self) -> str:
        if not self._short.value:
            return ""
        return f", latency short {self._short.value:.3g}s long {self._long.value:.3g}s"


class FixedLimiter(ConcurrencyLimiter):
    """No adaptation: the limit stays at ``ceiling`` (``concurrency_control = "fixed"``)."""

    algorithm = "fixed"

    def __init__(self, *, ceiling: int, clock: Clock | None = None) -> None:
        super().__init__(
            floor=ceiling,
            ceiling=ceiling,
            initial=None,
            cooldown=0.0,
            decrease_on=(),
            clock=clock,
        )

    @property
    def limit(self) -> int:
        """Always the ceiling."""
        return self.ceiling

    def on_success(self, latency: float, *, in_flight: int | None = None) -> None:
        """Nothing to learn."""

    def _decrease(self) -> None:
        """Never called: no failure kind counts."""


def make_limiter(settings: WorkerSettings, clock: Clock | None = None) -> ConcurrencyLimiter:
    """The limiter ``settings.concurrency_control`` names, between ``concurrency_floor``
    and ``concurrency``, starting at ``concurrency``."""
    control = settings.concurrency_control
    if control == "fixed":
        return FixedLimiter(ceiling=settings.concurrency, clock=clock)
    cls: type[AIMDLimiter] | type[GradientLimiter] = (
        AIMDLimiter if control == "aimd" else GradientLimiter
    )
    return cls(floor=settings.concurrency_floor, ceiling=settings.concurrency, clock=clock)
