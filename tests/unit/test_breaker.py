"""The circuit breaker on a fake clock: when it opens, how long it stays open, how its
half-open trials close or re-open it, and which settings it refuses."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline import ConfigError
from tokenline.backpressure import BreakerState, CallOutcome, CircuitBreaker, Permit

T0 = 1000.0


def breaker(**kwargs: Any) -> CircuitBreaker:
    options: dict[str, Any] = {"failure_rate": 0.5, "window": 10.0, "min_calls": 4}
    return CircuitBreaker(**(options | {"open_for": 30.0} | kwargs))


def call(b: CircuitBreaker, now: float, *, ok: bool, seconds: float = 0.1) -> CallOutcome:
    permit = b.try_acquire(now)
    assert permit is not None, f"refused at {now}: {b.describe(now)}"
    return b.on_success(permit, seconds, now) if ok else b.on_failure(permit, now)


def test_defaults_are_the_stated_ones() -> None:
    """resilience4j's rate and open time, Polly's window and single trial, 20 calls."""
    b = CircuitBreaker()
    assert (b.failure_rate, b.window, b.min_calls) == (0.5, 30.0, 20)
    assert (b.open_for, b.probe_calls, b.slow_call) == (60.0, 1, None)


def test_failures_below_min_calls_never_open_it() -> None:
    """Three failures out of three calls is 100%, but fewer than min_calls (4)."""
    b = breaker()
    for i in range(3):
        call(b, T0 + i, ok=False)
    assert b.state(T0 + 3) is BreakerState.CLOSED


def test_it_opens_at_the_threshold_once_min_calls_are_in() -> None:
    """With 4 calls in the window, 2 bad (50%) opens it; 1 bad (25%) does not."""
    b = breaker()
    call(b, T0, ok=False)
    for i in range(3):
        call(b, T0 + 1 + i, ok=True)
    assert b.state(T0 + 4) is BreakerState.CLOSED
    call(b, T0 + 4, ok=False)  # 2 bad of 5: 40%
    assert b.state(T0 + 4) is BreakerState.CLOSED
    call(b, T0 + 5, ok=False)  # 3 bad of 6: 50%
    assert b.state(T0 + 5) is BreakerState.OPEN
    assert b.remaining(T0 + 5) == pytest.approx(30.0)


def test_outcomes_older_than_the_window_are_forgotten() -> None:
    """Failures spread wider than the window never add up to min_calls."""
    b = breaker(window=2.0)
    for i in range(10):
        call(b, T0 + 3 * i, ok=False)
    assert b.state(T0 + 30) is BreakerState.CLOSED


def test_slow_successes_count_as_bad() -> None:
    """Successes slower than slow_call are SLOW and open the breaker like failures."""
    b = breaker(slow_call=1.0)
    assert call(b, T0, ok=True, seconds=0.5) is CallOutcome.OK
    for i in range(3):
        assert call(b, T0 + i, ok=True, seconds=1.5) is CallOutcome.SLOW
    assert b.state(T0 + 3) is BreakerState.OPEN


def test_open_refuses_every_call_then_turns_half_open_after_open_for() -> None:
    """Open for exactly open_for seconds: refused until then, half-open from then on."""
    b = breaker()
    b.trip(T0)
    assert b.try_acquire(T0 + 29.9) is None
    assert b.state(T0 + 29.9) is BreakerState.OPEN
    assert b.state(T0 + 30.0) is BreakerState.HALF_OPEN
    assert b.remaining(T0 + 30.0) == 0.0


def test_half_open_lets_probe_calls_through_and_a_success_closes() -> None:
    """One trial by default: a second caller is refused while it runs; its success
    closes the breaker with an empty window."""
    b = breaker()
    b.trip(T0)
    now = T0 + 30
    trial = b.try_acquire(now)
    assert trial is not None
    assert trial.trial
    assert b.try_acquire(now) is None
    assert b.on_success(trial, 0.1, now) is CallOutcome.OK
    assert b.state(now) is BreakerState.CLOSED
    assert b.calls(now) == 0


def test_a_failed_trial_opens_it_again_for_a_full_open_for() -> None:
    """The first bad trial re-opens the breaker, from the moment it failed."""
    b = breaker()
    b.trip(T0)
    trial = b.try_acquire(T0 + 40)
    assert trial is not None
    assert b.on_failure(trial, T0 + 41, timeout=True) is CallOutcome.TIMEOUT
    assert b.state(T0 + 41) is BreakerState.OPEN
    assert b.remaining(T0 + 41) == pytest.approx(30.0)


def test_all_probe_calls_must_succeed_to_close() -> None:
    """With probe_calls=3, three trials run at once; two successes are not enough."""
    b = breaker(probe_calls=3)
    b.trip(T0)
    now = T0 + 30
    trials = [b.try_acquire(now) for _ in range(4)]
    assert trials[3] is None
    first, second, third = (p for p in trials[:3] if p is not None)
    b.on_success(first, 0.1, now)
    b.on_success(second, 0.1, now)
    assert b.state(now) is BreakerState.HALF_OPEN
    assert b.try_acquire(now) is None  # two done, one in flight: no slot left
    b.on_success(third, 0.1, now)
    assert b.state(now) is BreakerState.CLOSED


def test_a_cancelled_trial_frees_its_slot_and_counts_nothing() -> None:
    """A trial that ended saying nothing about the dependency leaves it half-open, with
    room for the next trial."""
    b = breaker()
    b.trip(T0)
    trial = b.try_acquire(T0 + 30)
    assert trial is not None
    b.cancel(trial)
    assert b.state(T0 + 30) is BreakerState.HALF_OPEN
    assert b.try_acquire(T0 + 30) is not None


def test_outcomes_of_calls_begun_before_a_change_are_ignored() -> None:
    """Calls in flight when it opened cannot close it or count in the next period."""
    b = breaker()
    stragglers = [b.try_acquire(T0) for _ in range(5)]
    b.trip(T0 + 1)
    for p in stragglers:
        assert p is not None
        b.on_success(p, 0.1, T0 + 31)
    assert b.state(T0 + 31) is BreakerState.HALF_OPEN
    assert b.trials_in_flight == 0


def test_forced_changes_follow_a_shared_breaker() -> None:
    """trip keeps the later deadline; half_open only moves a closed breaker; reset closes."""
    b = breaker()
    b.trip(T0, until=T0 + 100)
    b.trip(T0 + 1)  # would end at T0 + 31: the later deadline stays
    assert b.open_until == T0 + 100
    b.half_open(T0 + 2)
    assert b.state(T0 + 2) is BreakerState.OPEN
    b.reset(T0 + 3)
    assert b.state(T0 + 3) is BreakerState.CLOSED
    b.half_open(T0 + 4)
    assert b.state(T0 + 4) is BreakerState.HALF_OPEN
    b.trip(T0 + 5, until=T0 + 5)  # a deadline already past opens nothing
    assert b.state(T0 + 5) is BreakerState.HALF_OPEN


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("failure_rate", 0),
        ("failure_rate", 1.01),
        ("failure_rate", math.nan),
        ("failure_rate", True),
        ("window", 0),
        ("window", -5),
        ("window", math.inf),
        ("min_calls", 0),
        ("min_calls", 2.5),
        ("open_for", 0),
        ("open_for", math.inf),
        ("slow_call", 0),
        ("slow_call", "1s"),
        ("probe_calls", 0),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(setting: str, value: object) -> None:
    """Each parameter is checked when the breaker is built; the error names it."""
    with pytest.raises(ConfigError) as info:
        CircuitBreaker(**{setting: value})
    assert info.value.setting == setting


def test_a_rate_of_one_is_allowed() -> None:
    """failure_rate lies in (0, 1]: 1 means open only when every call is bad."""
    b = breaker(failure_rate=1.0)
    for i in range(3):
        call(b, T0 + i, ok=False)
    call(b, T0 + 3, ok=True)
    assert b.state(T0 + 3) is BreakerState.CLOSED


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["ok", "bad", "cancel"]), st.floats(0, 5)),
        max_size=60,
    )
)
def test_it_never_opens_on_less_evidence_than_min_calls(steps: list[tuple[str, float]]) -> None:
    """Whatever the calls and their timing, a breaker that was never forced opens only
    with min_calls outcomes counted, and never has more trials than probe_calls."""
    b = breaker(min_calls=5, window=5.0, open_for=3.0, probe_calls=2)
    now = T0
    closed_calls = 0
    for kind, gap in steps:
        now += gap
        before = b.state(now)
        if before is BreakerState.CLOSED:
            closed_calls = b.calls(now)
        permit: Permit | None = b.try_acquire(now)
        if permit is None:
            assert before is not BreakerState.CLOSED
            continue
        if kind == "ok":
            b.on_success(permit, 0.1, now)
        elif kind == "bad":
            b.on_failure(permit, now)
        else:
            b.cancel(permit)
        if before is BreakerState.CLOSED and b.state(now) is BreakerState.OPEN:
            assert closed_calls + 1 >= 5
        assert b.trials_in_flight <= 2
