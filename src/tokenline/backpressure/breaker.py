"""A circuit breaker: stop calling a dependency that is failing, and try again later.

::

              failure rate >= failure_rate            open_for elapsed
              (with min_calls or more)                (read lazily)
    CLOSED ─────────────────────────────▶ OPEN ────────────────────────▶ HALF_OPEN
      ▲                                    ▲                               │   │
      │                                    └──────── a trial fails ────────┘   │
      └──────────────────── probe_calls trials succeed ────────────────────────┘

* **Closed**: every call goes through. Outcomes are counted over a sliding window of
  ``window`` seconds; a call is *bad* when it failed, timed out, or succeeded more
  slowly than ``slow_call`` seconds (when set). Once at least ``min_calls`` outcomes are
  in the window and the share of bad ones reaches ``failure_rate``, the breaker opens.
* **Open**: no call goes through, for ``open_for`` seconds.
* **Half-open**: up to ``probe_calls`` trial calls go through, one slot each; the
  first bad trial opens the breaker again for ``open_for``, and ``probe_calls`` good
  ones close it, with an empty window.

Each call asks :meth:`CircuitBreaker.try_acquire` for a :class:`Permit` (``None``: the
call is rejected) and hands it back with its outcome (:meth:`~CircuitBreaker.on_success`,
:meth:`~CircuitBreaker.on_failure`) or without one (:meth:`~CircuitBreaker.cancel`). A
permit remembers the state it was given in: the outcome of a call that began before the
last change of state says nothing about the new one and is ignored (a burst of calls
that were in flight when the breaker opened does not count against the half-open
trials, nor does one begun half-open close a breaker that has opened since).

:meth:`~CircuitBreaker.trip`, :meth:`~CircuitBreaker.half_open` and
:meth:`~CircuitBreaker.reset` force a state: a worker uses them to follow a breaker
shared through the store (see :mod:`tokenline.dependencies`).

Defaults
--------

``failure_rate`` 0.5 and ``open_for`` 60 s are resilience4j's. Its window is the last
100 calls, with 100 needed; jobs arrive unevenly, so the window here is Polly v8's 30 s
of sampling, and 20 calls suffice (as for the worker's error window: ten slots running
multi-second jobs may not make 100 calls in 30 s). Half-open lets one trial through,
as Polly v8 does: resilience4j's 10 trials judged by their rate suit RPC volumes, not
jobs. Slow calls count only when ``slow_call`` is set (resilience4j counts calls over
60 s, against a slow-call threshold of 100% that hardly ever trips by itself).

Pure and clock-injected: every call takes ``now``, a monotonic reading in seconds;
memory is bounded by the window's buckets. Not thread-safe.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._checks import check_fraction, check_int, check_now, check_positive
from ._window import MAX_BUCKETS, SlidingCounts

__all__ = [
    "DEFAULT_BREAKER_WINDOW",
    "DEFAULT_FAILURE_RATE",
    "DEFAULT_OPEN_FOR",
    "DEFAULT_PROBE_CALLS",
    "DEFAULT_SLOW_CALL",
    "MIN_CALLS",
    "BreakerState",
    "CallOutcome",
    "CircuitBreaker",
    "Permit",
]

#: Share of bad calls that opens the breaker (resilience4j's ``failureRateThreshold``).
DEFAULT_FAILURE_RATE = 0.5
#: Seconds of outcomes considered (Polly v8's sampling duration).
DEFAULT_BREAKER_WINDOW = 30.0
#: Outcomes needed within the window before the rate is acted on.
MIN_CALLS = 20
#: Seconds the breaker stays open (resilience4j's ``waitDurationInOpenState``).
DEFAULT_OPEN_FOR = 60.0
#: Trial calls let through half-open, all of which must succeed to close (Polly v8: 1).
DEFAULT_PROBE_CALLS = 1
#: A success slower than this many seconds counts as bad; ``None``: speed not judged.
DEFAULT_SLOW_CALL: float | None = None

_OK, _BAD = 0, 1


class BreakerState(enum.StrEnum):
    """Where a breaker is: calls go through, are refused, or are tried a few at a time."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CallOutcome(enum.StrEnum):
    """How one call to a dependency went, as a breaker counts it."""

    #: It succeeded in time.
    OK = "ok"
    #: It raised.
    FAILED = "failed"
    #: It succeeded, more slowly than ``slow_call``: counted as bad.
    SLOW = "slow"
    #: It ran past the dependency's timeout: counted as bad.
    TIMEOUT = "timeout"
    #: The breaker did not let it through (never counted in the window).
    REJECTED = "rejected"

    @property
    def is_bad(self) -> bool:
        """Whether it counts towards opening the breaker."""
        return self in (CallOutcome.FAILED, CallOutcome.SLOW, CallOutcome.TIMEOUT)


@dataclass(frozen=True, slots=True)
class Permit:
    """Leave to make one call, from :meth:`CircuitBreaker.try_acquire`."""

    #: The breaker's count of state changes when the permit was given.
    generation: int
    #: A half-open trial: its outcome decides whether the breaker closes.
    trial: bool


class CircuitBreaker:
    """Closed, open or half-open, from the outcomes of recent calls (module docstring)."""

    def __init__(
        self,
        *,
        failure_rate: float = DEFAULT_FAILURE_RATE,
        window: float = DEFAULT_BREAKER_WINDOW,
        min_calls: int = MIN_CALLS,
        open_for: float = DEFAULT_OPEN_FOR,
        slow_call: float | None = DEFAULT_SLOW_CALL,
        probe_calls: int = DEFAULT_PROBE_CALLS,
        resolution: float | None = None,
    ) -> None:
        """``failure_rate`` lies in (0, 1]; ``window``, ``open_for`` and ``slow_call`` are
        positive seconds; ``min_calls`` and ``probe_calls`` at least 1. ``resolution``:
        bucket width of the window, by default a tenth of it, at most a second."""
        self.failure_rate = check_fraction("failure_rate", failure_rate, closed_top=True)
        self.window = check_positive("window", window)
        self.min_calls = check_int("min_calls", min_calls, minimum=1)
        self.open_for = check_positive("open_for", open_for)
        self.slow_call = None if slow_call is None else check_positive("slow_call", slow_call)
        self.probe_calls = check_int("probe_calls", probe_calls, minimum=1)
        self.resolution = (
            max(min(1.0, self.window / 10), self.window / MAX_BUCKETS)
            if resolution is None
            else check_positive("resolution", resolution)
        )
        self._counts = self._new_window()
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._open_until: float | None = None
        self._trials = 0  # half-open trials in flight
        self._trial_ok = 0  # half-open trials that succeeded

    def _new_window(self) -> SlidingCounts:
        return SlidingCounts(window=self.window, resolution=self.resolution, fields=2)

    # -- state -----------------------------------------------------------------------------
    def state(self, now: float) -> BreakerState:
        """The state at ``now``: an open breaker whose time is up is half-open."""
        now = check_now(now)
        if (
            self._state is BreakerState.OPEN
            and self._open_until is not None
            and now >= self._open_until
        ):
            self._move(BreakerState.HALF_OPEN)
        return self._state

    @property
    def open_until(self) -> float | None:
        """Monotonic time the breaker stops being open (``None`` when it is not open)."""
        return self._open_until if self._state is BreakerState.OPEN else None

    def remaining(self, now: float) -> float:
        """Seconds the breaker stays open from ``now`` (0 when it is not open)."""
        if self.state(now) is not BreakerState.OPEN or self._open_until is None:
            return 0.0
        return max(0.0, self._open_until - now)

    @property
    def trials_in_flight(self) -> int:
        """Half-open trial calls let through and not yet handed back."""
        return self._trials

    def trial_free(self, now: float) -> bool:
        """Whether a half-open trial could be let through now."""
        return (
            self.state(now) is BreakerState.HALF_OPEN
            and self._trials + self._trial_ok < self.probe_calls
        )

    def _move(self, state: BreakerState) -> None:
        self._state = state
        self._generation += 1
        self._trials = self._trial_ok = 0
        if state is not BreakerState.OPEN:
            self._open_until = None
        # The evidence of one period must not decide the next one.
        self._counts = self._new_window()

    # -- calls -----------------------------------------------------------------------------
    def try_acquire(self, now: float) -> Permit | None:
        """A permit for one call, or ``None`` when the breaker refuses it."""
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return Permit(self._generation, trial=False)
        if state is BreakerState.HALF_OPEN and self.trial_free(now):
            self._trials += 1
            return Permit(self._generation, trial=True)
        return None

    def on_success(self, permit: Permit, seconds: float, now: float) -> CallOutcome:
        """The call of ``permit`` succeeded after ``seconds``: ``OK``, or ``SLOW`` past
        ``slow_call``. Returns how it was counted."""
        slow = self.slow_call is not None and seconds > self.slow_call
        outcome = CallOutcome.SLOW if slow else CallOutcome.OK
        self._record(permit, outcome, now)
        return outcome

    def on_failure(self, permit: Permit, now: float, *, timeout: bool = False) -> CallOutcome:
        """The call of ``permit`` failed (``timeout``: it ran past its time limit)."""
        outcome = CallOutcome.TIMEOUT if timeout else CallOutcome.FAILED
        self._record(permit, outcome, now)
        return outcome

    def cancel(self, permit: Permit) -> None:
        """The call of ``permit`` ended saying nothing about the dependency (the job was
        cancelled, or failed through its own fault): free its trial slot, count nothing."""
        if permit.trial and permit.generation == self._generation and self._trials > 0:
            self._trials -= 1

    def _record(self, permit: Permit, outcome: CallOutcome, now: float) -> None:
        state = self.state(now)
        if permit.generation != self._generation:
            return  # begun under an earlier state: says nothing about this one
        if state is BreakerState.CLOSED:
            self._counts.add(now, _BAD if outcome.is_bad else _OK)
            if self._should_open(now):
                self.trip(now)
        elif state is BreakerState.HALF_OPEN and permit.trial:
            self._trials -= 1
            if outcome.is_bad:
                self.trip(now)
            else:
                self._trial_ok += 1
                if self._trial_ok >= self.probe_calls:
                    self._move(BreakerState.CLOSED)

    def _should_open(self, now: float) -> bool:
        ok, bad = self._counts.totals(now)
        calls = ok + bad
        return calls >= self.min_calls and bad >= self.failure_rate * calls

    # -- forced changes --------------------------------------------------------------------
    def trip(self, now: float, *, until: float | None = None) -> None:
        """Open now, until ``until`` (monotonic; default ``now + open_for``). An open
        breaker keeps the later of its deadline and ``until``."""
        now = check_now(now)
        deadline = now + self.open_for if until is None else check_now(until)
        if deadline <= now:
            return
        if self.state(now) is BreakerState.OPEN and self._open_until is not None:
            self._open_until = max(self._open_until, deadline)
            return
        self._move(BreakerState.OPEN)
        self._open_until = deadline

    def half_open(self, now: float) -> None:
        """Move a closed breaker to half-open (someone else's breaker opened and nobody
        has tried the dependency since); an open or half-open one is left as it is."""
        if self.state(now) is BreakerState.CLOSED:
            self._move(BreakerState.HALF_OPEN)

    def reset(self, now: float) -> None:
        """Close, with an empty window (someone else's trial succeeded)."""
        if self.state(now) is not BreakerState.CLOSED:
            self._move(BreakerState.CLOSED)

    # -- reading ---------------------------------------------------------------------------
    def calls(self, now: float) -> int:
        """Outcomes counted within the window (closed state only)."""
        ok, bad = self._counts.totals(now)
        return ok + bad

    def rate(self, now: float) -> float:
        """Share of bad outcomes within the window, in [0, 1]; 0 when it is empty."""
        ok, bad = self._counts.totals(now)
        return bad / (ok + bad) if ok + bad else 0.0

    def describe(self, now: float) -> str:
        """The state in one line for logs."""
        state = self.state(now)
        if state is BreakerState.OPEN:
            return f"open for {self.remaining(now):.1f}s more"
        if state is BreakerState.HALF_OPEN:
            return f"half-open, {self._trials} of {self.probe_calls} trial calls in flight"
        return (
            f"closed, {self.rate(now):.0%} bad of {self.calls(now)} calls in {self.window:g}s "
            f"(opens at {self.failure_rate:.0%} with {self.min_calls} or more)"
        )

    def __repr__(self) -> str:
        return (
            f"CircuitBreaker(state={self._state.value}, failure_rate={self.failure_rate!r}, "
            f"window={self.window!r}, min_calls={self.min_calls!r}, open_for={self.open_for!r})"
        )
