"""Backpressure pieces: adaptive limiters, retry budget and error-rate window, on a fake clock."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline import ConfigError, FakeClock
from tokenline.backpressure import (
    OVERLOAD_KINDS,
    AIMDLimiter,
    ConcurrencyLimiter,
    ErrorRateWindow,
    FailureKind,
    GradientLimiter,
    RetryBudget,
)
from tokenline.backpressure._window import MAX_BUCKETS, SlidingCounts
from tokenline.classify import ErrorClass

FAST = 0.05


def aimd(clock: FakeClock, **kwargs: Any) -> AIMDLimiter:
    return AIMDLimiter(clock=clock, **kwargs)


def gradient(clock: FakeClock, **kwargs: Any) -> GradientLimiter:
    return GradientLimiter(clock=clock, **kwargs)


# --- failure kinds -------------------------------------------------------------------


def test_failure_kind_follows_the_classifier() -> None:
    """Each ErrorClass maps to the FailureKind of the same name."""
    assert FailureKind.from_error_class(ErrorClass.TRANSIENT) is FailureKind.TRANSIENT
    assert FailureKind.from_error_class(ErrorClass.PERMANENT) is FailureKind.PERMANENT
    assert FailureKind.from_error_class(ErrorClass.COORDINATION) is FailureKind.COORDINATION


def test_only_permanent_failures_are_not_overload() -> None:
    """Timeouts, transient and coordination failures signal overload; permanent ones do not."""
    assert {k for k in FailureKind if not k.is_overload} == {FailureKind.PERMANENT}
    assert FailureKind.PERMANENT not in OVERLOAD_KINDS


# --- AIMD ----------------------------------------------------------------------------


def test_aimd_starts_at_the_ceiling_by_default() -> None:
    """Without ``initial`` a worker starts at its configured concurrency."""
    assert AIMDLimiter(ceiling=12).limit == 12


def test_aimd_grows_to_the_ceiling_under_steady_fast_successes() -> None:
    """From the floor, a long run of fast successes brings the limit to the ceiling, no further."""
    clock = FakeClock()
    limiter = aimd(clock, floor=1, ceiling=20, initial=1)
    seen = []
    for _ in range(1_000):
        limiter.on_success(FAST)
        seen.append(limiter.limit)
    assert limiter.limit == 20
    assert seen == sorted(seen)
    assert max(seen) == 20


def test_aimd_adds_one_per_round_of_successes_by_default() -> None:
    """By default +1 needs as many successes as the current limit (one full round)."""
    limiter = aimd(FakeClock(), ceiling=10, initial=4)
    for _ in range(3):
        limiter.on_success(FAST)
    assert limiter.limit == 4
    limiter.on_success(FAST)
    assert limiter.limit == 5


def test_aimd_increase_after_sets_the_streak_length() -> None:
    """With ``increase_after=3`` every third fast success adds one."""
    limiter = aimd(FakeClock(), ceiling=10, initial=2, increase_after=3)
    for _ in range(6):
        limiter.on_success(FAST)
    assert limiter.limit == 4


def test_aimd_slow_successes_do_not_grow_the_limit() -> None:
    """A success slower than ``slow_latency`` restarts the streak instead of extending it."""
    limiter = aimd(FakeClock(), ceiling=10, initial=2, increase_after=2, slow_latency=1.0)
    for _ in range(50):
        limiter.on_success(FAST)
        limiter.on_success(5.0)
    assert limiter.limit == 2


def test_aimd_does_not_grow_while_the_worker_idles() -> None:
    """Successes with less than half the limit in flight prove nothing about a larger limit."""
    limiter = aimd(FakeClock(), ceiling=20, initial=10, increase_after=1)
    for _ in range(100):
        limiter.on_success(FAST, in_flight=4)
    assert limiter.limit == 10
    limiter.on_success(FAST, in_flight=5)
    assert limiter.limit == 11


def test_aimd_halves_once_on_a_burst_of_timeouts() -> None:
    """Ten simultaneous timeouts halve the limit once, thanks to the cool-down."""
    clock = FakeClock()
    limiter = aimd(clock, ceiling=40, factor=0.5, cooldown=1.0)
    for _ in range(10):
        limiter.on_failure(FailureKind.TIMEOUT)
        clock.advance(0.05)
    assert limiter.limit == 20


def test_aimd_decreases_again_after_the_cooldown() -> None:
    """Failures that go on past the cool-down decrease again."""
    clock = FakeClock()
    limiter = aimd(clock, ceiling=40, factor=0.5, cooldown=1.0)
    limiter.on_failure(FailureKind.TIMEOUT)
    clock.advance(1.0)
    limiter.on_failure(FailureKind.TRANSIENT)
    assert limiter.limit == 10


def test_aimd_ignores_failures_of_jobs_started_before_the_last_decrease() -> None:
    """A job admitted under the old limit cannot cause a second decrease, even late."""
    clock = FakeClock()
    limiter = aimd(clock, ceiling=40, factor=0.5, cooldown=1.0)
    started = clock.monotonic()
    clock.advance(30)
    limiter.on_failure(FailureKind.TIMEOUT, started=started)
    clock.advance(30)
    limiter.on_failure(FailureKind.TIMEOUT, started=started)
    assert limiter.limit == 20
    limiter.on_failure(FailureKind.TIMEOUT, started=clock.monotonic())
    assert limiter.limit == 10


def test_aimd_never_goes_below_the_floor() -> None:
    """Decrease after decrease, the limit stops at the floor."""
    clock = FakeClock()
    limiter = aimd(clock, floor=3, ceiling=50, factor=0.5, cooldown=0.0)
    for _ in range(20):
        limiter.on_failure(FailureKind.COORDINATION)
    assert limiter.limit == 3


def test_aimd_permanent_errors_do_not_shrink_the_limit() -> None:
    """Permanent failures are the job's fault: the limit and the growth streak stay put."""
    clock = FakeClock()
    limiter = aimd(clock, ceiling=10, initial=5, increase_after=2, cooldown=0.0)
    limiter.on_success(FAST)
    for _ in range(100):
        limiter.on_failure(FailureKind.PERMANENT)
        clock.advance(5)
    assert limiter.limit == 5
    limiter.on_success(FAST)
    assert limiter.limit == 6


def test_aimd_an_overload_failure_restarts_the_streak() -> None:
    """A failure within the cool-down does not decrease, but its streak starts over."""
    clock = FakeClock()
    limiter = aimd(clock, ceiling=10, initial=8, increase_after=2, factor=0.5)
    limiter.on_failure(FailureKind.TIMEOUT)
    assert limiter.limit == 4
    limiter.on_success(FAST)
    limiter.on_failure(FailureKind.TIMEOUT)  # within the cool-down: no decrease
    limiter.on_success(FAST)
    assert limiter.limit == 4
    limiter.on_success(FAST)
    assert limiter.limit == 5


def test_decrease_on_chooses_which_failures_count() -> None:
    """With ``decrease_on={TIMEOUT}`` a transient error leaves the limit alone."""
    limiter = aimd(FakeClock(), ceiling=10, decrease_on={FailureKind.TIMEOUT})
    limiter.on_failure(FailureKind.TRANSIENT)
    assert limiter.limit == 10
    limiter.on_failure(FailureKind.TIMEOUT)
    assert limiter.limit == 5


def test_failure_kind_may_be_given_by_its_value() -> None:
    """A plain string naming a kind works, and an unknown one is refused."""
    limiter = aimd(FakeClock(), ceiling=10)
    limiter.on_failure("timeout")  # type: ignore[arg-type]
    assert limiter.limit == 5
    with pytest.raises(ValueError, match="bogus"):
        limiter.on_failure("bogus")  # type: ignore[arg-type]


def test_describe_and_repr_show_the_state() -> None:
    """``describe`` gives limit, floor, ceiling and algorithm in one line; so does repr."""
    clock = FakeClock()
    limiter = aimd(clock, floor=1, ceiling=50, initial=12)
    assert limiter.describe() == "limit 12 (floor 1, ceiling 50), AIMD"
    assert repr(limiter) == "AIMDLimiter(limit=12, floor=1, ceiling=50)"
    limiter.on_failure(FailureKind.TIMEOUT)
    clock.advance(2.5)
    assert limiter.describe() == "limit 6 (floor 1, ceiling 50), AIMD, last decrease 2.5s ago"


# --- gradient ------------------------------------------------------------------------


def feed(limiter: ConcurrencyLimiter, latency: float, n: int) -> None:
    for _ in range(n):
        limiter.on_success(latency)


def test_gradient_grows_to_the_ceiling_at_steady_latency() -> None:
    """When latency does not change, the gradient is 1 and the limit climbs to the ceiling."""
    limiter = gradient(FakeClock(), ceiling=30, initial=1)
    feed(limiter, 0.1, 200)
    assert limiter.limit == 30


def test_gradient_limit_falls_when_latency_rises_and_recovers_after() -> None:
    """Jobs three times slower pull the limit down; back to normal, it climbs back."""
    limiter = gradient(FakeClock(), floor=1, ceiling=40)
    feed(limiter, 0.1, 600)
    assert limiter.limit == 40
    feed(limiter, 0.3, 30)
    low = limiter.limit
    assert low < 20
    feed(limiter, 0.1, 300)
    assert limiter.limit == 40


def test_gradient_limit_stays_within_floor_and_ceiling() -> None:
    """A hundredfold slowdown stops at the floor; steady fast jobs stop at the ceiling."""
    limiter = gradient(FakeClock(), floor=4, ceiling=16, queue_allowance=0.0)
    feed(limiter, 0.01, 600)
    seen = []
    for _ in range(100):
        limiter.on_success(1.0)
        seen.append(limiter.limit)
    assert min(seen) == 4
    limiter = gradient(FakeClock(), floor=4, ceiling=16, initial=4)
    feed(limiter, 0.000_001, 2_000)
    assert limiter.limit == 16


def test_gradient_tracks_short_and_long_latency() -> None:
    """The short-term average follows a change quickly, the long-term one slowly."""
    limiter = gradient(FakeClock(), ceiling=10)
    feed(limiter, 0.1, 600)
    feed(limiter, 0.2, 20)
    assert limiter.short_rtt == pytest.approx(0.2, rel=0.05)
    assert limiter.long_rtt < 0.12
    assert "latency short 0.198s long 0.106s" in limiter.describe()


def test_gradient_does_not_grow_while_the_worker_idles() -> None:
    """With less than half the limit in flight, latency is sampled but the limit holds."""
    limiter = gradient(FakeClock(), ceiling=20, initial=10)
    for _ in range(100):
        limiter.on_success(0.1, in_flight=2)
    assert limiter.limit == 10


def test_gradient_shrinks_on_overload_failures_not_on_permanent_ones() -> None:
    """A timeout multiplies the limit by ``factor``; permanent failures change nothing."""
    clock = FakeClock()
    limiter = gradient(clock, ceiling=20, factor=0.5)
    for _ in range(10):
        limiter.on_failure(FailureKind.PERMANENT)
    assert limiter.limit == 20
    limiter.on_failure(FailureKind.TIMEOUT)
    limiter.on_failure(FailureKind.TIMEOUT)
    assert limiter.limit == 10
    assert limiter.describe() == "limit 10 (floor 1, ceiling 20), gradient, last decrease 0.0s ago"


@pytest.mark.parametrize("latency", [-1.0, math.nan, math.inf])
def test_a_latency_that_is_not_a_duration_is_refused(latency: float) -> None:
    """Negative, NaN or infinite latencies are bugs in the caller, not samples."""
    for limiter in (AIMDLimiter(), GradientLimiter()):
        with pytest.raises(ValueError, match="latency"):
            limiter.on_success(latency)


def test_a_zero_latency_is_a_valid_sample() -> None:
    """A job that finished within one clock tick does not divide by zero."""
    limiter = gradient(FakeClock(), ceiling=5)
    feed(limiter, 0.0, 20)
    assert limiter.limit == 5


# --- claim_batch ---------------------------------------------------------------------


def test_claim_batch_stops_at_the_limit() -> None:
    """With 6 of a limit of 8 in flight, only 2 more may be claimed whatever is free."""
    limiter = aimd(FakeClock(), ceiling=8)
    assert limiter.claim_batch(50, in_flight=6) == 2
    assert limiter.claim_batch(1, in_flight=6) == 1
    assert limiter.claim_batch(50, in_flight=8) == 0
    assert limiter.claim_batch(50, in_flight=12) == 0  # after a decrease


@given(
    limit=st.integers(min_value=1, max_value=100),
    free=st.integers(min_value=-5, max_value=200),
    in_flight=st.integers(min_value=0, max_value=200),
)
def test_claim_batch_never_exceeds_free_slots_or_the_limit(
    limit: int, free: int, in_flight: int
) -> None:
    """The batch is never negative, never above the free slots, never past the limit."""
    limiter = AIMDLimiter(floor=1, ceiling=limit)
    batch = limiter.claim_batch(free, in_flight=in_flight)
    assert 0 <= batch <= max(free, 0)
    assert batch == 0 or in_flight + batch <= limiter.limit


# --- properties over any sequence of events ------------------------------------------

events = st.lists(
    st.one_of(
        st.tuples(
            st.just("success"),
            st.floats(min_value=0.0, max_value=1e4),
            st.one_of(st.none(), st.integers(min_value=0, max_value=500)),
        ),
        st.tuples(st.just("failure"), st.sampled_from(list(FailureKind)), st.booleans()),
        st.tuples(st.just("tick"), st.floats(min_value=0.0, max_value=100.0), st.none()),
    ),
    max_size=200,
)


def play(limiter: ConcurrencyLimiter, clock: FakeClock, script: list[tuple[Any, ...]]) -> None:
    start = clock.monotonic()
    for kind, a, b in script:
        if kind == "success":
            limiter.on_success(a, in_flight=b)
        elif kind == "failure":
            limiter.on_failure(a, started=start if b else None)
        else:
            clock.advance(a)
        assert limiter.floor <= limiter.limit <= limiter.ceiling


@st.composite
def bounds(draw: st.DrawFn) -> tuple[int, int, int]:
    floor = draw(st.integers(min_value=1, max_value=50))
    ceiling = draw(st.integers(min_value=floor, max_value=200))
    initial = draw(st.integers(min_value=floor, max_value=ceiling))
    return floor, ceiling, initial


@settings(max_examples=200)
@given(
    b=bounds(),
    factor=st.floats(min_value=0.01, max_value=0.99),
    increase_after=st.one_of(st.none(), st.integers(min_value=1, max_value=5)),
    script=events,
)
def test_aimd_limit_stays_within_bounds_for_any_events(
    b: tuple[int, int, int], factor: float, increase_after: int | None, script: list[Any]
) -> None:
    """Whatever happens, in any order, the AIMD limit stays in [floor, ceiling]."""
    clock = FakeClock()
    floor, ceiling, initial = b
    limiter = AIMDLimiter(
        floor=floor,
        ceiling=ceiling,
        initial=initial,
        factor=factor,
        increase_after=increase_after,
        clock=clock,
    )
    play(limiter, clock, script)


@settings(max_examples=200)
@given(
    b=bounds(),
    smoothing=st.floats(min_value=0.01, max_value=1.0),
    queue_allowance=st.one_of(st.none(), st.floats(min_value=0.0, max_value=50.0)),
    script=events,
)
def test_gradient_limit_stays_within_bounds_for_any_events(
    b: tuple[int, int, int], smoothing: float, queue_allowance: float | None, script: list[Any]
) -> None:
    """Whatever happens, in any order, the gradient limit stays in [floor, ceiling]."""
    clock = FakeClock()
    floor, ceiling, initial = b
    limiter = GradientLimiter(
        floor=floor,
        ceiling=ceiling,
        initial=initial,
        smoothing=smoothing,
        queue_allowance=queue_allowance,
        clock=clock,
    )
    play(limiter, clock, script)


@given(
    b=bounds(),
    algorithm=st.sampled_from([AIMDLimiter, GradientLimiter]),
    gaps=st.lists(st.floats(min_value=0.0, max_value=100.0), max_size=50),
)
def test_permanent_failures_alone_never_move_the_limit(
    b: tuple[int, int, int], algorithm: type[ConcurrencyLimiter], gaps: list[float]
) -> None:
    """Any number of permanent failures, at any pace, leaves the limit where it was."""
    clock = FakeClock()
    floor, ceiling, initial = b
    limiter = algorithm(floor=floor, ceiling=ceiling, initial=initial, clock=clock)  # type: ignore[call-arg]
    for gap in gaps:
        clock.advance(gap)
        limiter.on_failure(FailureKind.PERMANENT)
    assert limiter.limit == initial


# --- limiter settings ----------------------------------------------------------------

BAD_LIMITER_SETTINGS: list[tuple[type[ConcurrencyLimiter], dict[str, Any], str]] = [
    (AIMDLimiter, {"floor": 0}, "floor"),
    (AIMDLimiter, {"floor": 20, "ceiling": 10}, "floor"),
    (AIMDLimiter, {"floor": 1.5}, "floor"),
    (AIMDLimiter, {"ceiling": 0}, "ceiling"),
    (AIMDLimiter, {"ceiling": True}, "ceiling"),
    (AIMDLimiter, {"floor": 2, "initial": 1}, "initial"),
    (AIMDLimiter, {"ceiling": 5, "initial": 6}, "initial"),
    (AIMDLimiter, {"factor": 0.0}, "factor"),
    (AIMDLimiter, {"factor": 1.0}, "factor"),
    (AIMDLimiter, {"factor": math.nan}, "factor"),
    (AIMDLimiter, {"factor": math.inf}, "factor"),
    (AIMDLimiter, {"factor": "0.5"}, "factor"),
    (AIMDLimiter, {"increase_after": 0}, "increase_after"),
    (AIMDLimiter, {"slow_latency": 0.0}, "slow_latency"),
    (AIMDLimiter, {"slow_latency": math.inf}, "slow_latency"),
    (AIMDLimiter, {"cooldown": -1.0}, "cooldown"),
    (AIMDLimiter, {"cooldown": math.nan}, "cooldown"),
    (AIMDLimiter, {"decrease_on": {FailureKind.PERMANENT}}, "decrease_on"),
    (AIMDLimiter, {"decrease_on": {"overload"}}, "decrease_on"),
    (GradientLimiter, {"floor": 11, "ceiling": 10}, "floor"),
    (GradientLimiter, {"tolerance": 0.9}, "tolerance"),
    (GradientLimiter, {"tolerance": math.inf}, "tolerance"),
    (GradientLimiter, {"smoothing": 0.0}, "smoothing"),
    (GradientLimiter, {"smoothing": 1.5}, "smoothing"),
    (GradientLimiter, {"long_window": 1}, "long_window"),
    (GradientLimiter, {"short_window": 0}, "short_window"),
    (GradientLimiter, {"short_window": 600, "long_window": 600}, "short_window"),
    (GradientLimiter, {"min_gradient": 0.0}, "min_gradient"),
    (GradientLimiter, {"min_gradient": 1.1}, "min_gradient"),
    (GradientLimiter, {"queue_allowance": -1.0}, "queue_allowance"),
    (GradientLimiter, {"queue_allowance": math.nan}, "queue_allowance"),
    (GradientLimiter, {"factor": 1.0}, "factor"),
    (GradientLimiter, {"decrease_on": [FailureKind.PERMANENT]}, "decrease_on"),
]


@pytest.mark.parametrize(("cls", "kwargs", "name"), BAD_LIMITER_SETTINGS)
def test_a_bad_limiter_setting_is_a_config_error_naming_it(
    cls: type[ConcurrencyLimiter], kwargs: dict[str, Any], name: str
) -> None:
    """Each out-of-range, non-finite or mistyped parameter is refused by name."""
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    assert info.value.setting == name
    assert name in str(info.value)


def test_floor_equal_to_ceiling_is_a_fixed_limit() -> None:
    """``floor == ceiling`` is allowed: the limiter then never moves."""
    limiter = AIMDLimiter(floor=4, ceiling=4, cooldown=0.0)
    limiter.on_failure(FailureKind.TIMEOUT)
    feed(limiter, FAST, 100)
    assert limiter.limit == 4


# --- retry budget --------------------------------------------------------------------


def spend_all(budget: RetryBudget, queue: str, now: float, most: int = 10_000) -> int:
    granted = 0
    while granted < most and budget.try_spend(queue, now):
        granted += 1
    return granted


def test_retry_budget_allows_ratio_of_first_attempts() -> None:
    """100 first attempts at ratio 0.2 and no floor allow exactly 20 retries."""
    budget = RetryBudget(ratio=0.2, window=60.0, min_per_second=0.0)
    for i in range(100):
        budget.deposit("mail", 1000.0 + i * 0.1)
    assert spend_all(budget, "mail", 1010.0) == 20
    assert not budget.try_spend("mail", 1010.0)


def test_retry_budget_floor_allows_a_few_retries_without_traffic() -> None:
    """With no first attempts, ``min_per_second * window`` retries are still allowed."""
    budget = RetryBudget(ratio=0.2, window=60.0, min_per_second=0.1)
    assert budget.available("quiet", 0.0) == pytest.approx(6.0)
    assert spend_all(budget, "quiet", 0.0) == 6


def test_retry_budget_ratio_and_floor_add_up() -> None:
    """Ten first attempts at 0.2, plus a floor of 3 over the window, give 5 retries."""
    budget = RetryBudget(ratio=0.2, window=30.0, min_per_second=0.1)
    for _ in range(10):
        budget.deposit("q", 5.0)
    assert spend_all(budget, "q", 5.0) == 5


def test_retry_budget_recovers_after_the_window() -> None:
    """Retries spent leave the window with time, and the budget is whole again."""
    budget = RetryBudget(ratio=0.2, window=60.0, min_per_second=0.1)
    assert spend_all(budget, "q", 100.0) == 6
    assert not budget.try_spend("q", 130.0)
    assert spend_all(budget, "q", 161.0) == 6


def test_retry_budget_first_attempts_expire_too() -> None:
    """First attempts older than the window no longer earn retries."""
    budget = RetryBudget(ratio=0.5, window=10.0, min_per_second=0.0)
    for _ in range(10):
        budget.deposit("q", 0.0)
    assert budget.available("q", 9.0) == pytest.approx(5.0)
    assert budget.available("q", 11.0) == 0.0
    assert not budget.try_spend("q", 11.0)


def test_retry_budget_is_per_queue() -> None:
    """One queue's first attempts do not pay for another queue's retries."""
    budget = RetryBudget(ratio=1.0, window=60.0, min_per_second=0.0)
    for _ in range(5):
        budget.deposit("busy", 0.0)
    assert not budget.try_spend("other", 0.0)
    assert spend_all(budget, "busy", 0.0) == 5


def test_retry_budget_tracks_a_bounded_number_of_queues() -> None:
    """Ten thousand queue names keep at most ``max_queues`` in memory, recent ones first."""
    budget = RetryBudget(max_queues=100, min_per_second=0.0, ratio=1.0)
    for i in range(10_000):
        budget.deposit(f"q{i}", float(i))
    assert budget.queues_tracked == 100
    assert budget.available("q9999", 9_999.0) == 1.0
    assert budget.available("q0", 9_999.0) == 0.0


def test_retry_budget_keeps_recently_used_queues() -> None:
    """A queue used again moves to the front, so a newcomer evicts the idle one."""
    budget = RetryBudget(max_queues=2, min_per_second=0.0, ratio=1.0)
    budget.deposit("a", 0.0)
    budget.deposit("b", 0.0)
    budget.deposit("a", 0.0)
    budget.deposit("c", 0.0)
    assert budget.available("a", 0.0) == 2.0
    assert budget.available("b", 0.0) == 0.0


def test_retry_budget_describe() -> None:
    """``describe`` names the queue, the counts and what is left."""
    budget = RetryBudget(ratio=0.2, window=60.0, min_per_second=0.0)
    for _ in range(10):
        budget.deposit("mail", 0.0)
    assert budget.try_spend("mail", 0.0)
    assert budget.describe("mail", 0.0) == (
        "retry budget of 'mail': 1 retries for 10 first attempts in 60s, 1.0 left "
        "(ratio 0.2, floor 0/s)"
    )
    assert "RetryBudget(ratio=0.2" in repr(budget)
    assert budget.try_spend("mail", 0.0)
    # Spent: what is left is no whole retry, and is said so, not as "0.0 left" beside it.
    assert not budget.try_spend("mail", 0.0)
    assert ", less than one left (0.0) " in budget.describe("mail", 0.0)


@settings(max_examples=200)
@given(
    ratio=st.floats(min_value=0.01, max_value=1.0),
    floor=st.floats(min_value=0.0, max_value=1.0),
    script=st.lists(st.booleans(), max_size=300),
)
def test_retry_budget_never_grants_more_than_it_allows(
    ratio: float, floor: float, script: list[bool]
) -> None:
    """Within one window, granted retries never exceed ratio * first attempts + the floor."""
    window = 10.0
    budget = RetryBudget(ratio=ratio, window=window, min_per_second=floor)
    deposits = granted = 0
    for is_first_attempt in script:
        if is_first_attempt:
            budget.deposit("q", 0.5)
            deposits += 1
        elif budget.try_spend("q", 0.5):
            granted += 1
        assert granted <= ratio * deposits + floor * window + 1e-6


BAD_BUDGET_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"ratio": 0.0}, "ratio"),
    ({"ratio": 1.5}, "ratio"),
    ({"ratio": math.nan}, "ratio"),
    ({"window": 0.0}, "window"),
    ({"window": math.inf}, "window"),
    ({"min_per_second": -0.1}, "min_per_second"),
    ({"min_per_second": math.inf}, "min_per_second"),
    ({"max_queues": 0}, "max_queues"),
    ({"resolution": 0.0}, "resolution"),
    ({"resolution": 120.0}, "resolution"),
    ({"window": 86_400.0}, "resolution"),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD_BUDGET_SETTINGS)
def test_a_bad_retry_budget_setting_is_a_config_error_naming_it(
    kwargs: dict[str, Any], name: str
) -> None:
    """Out-of-range retry budget parameters are refused by name."""
    with pytest.raises(ConfigError) as info:
        RetryBudget(**kwargs)
    assert info.value.setting == name


# --- error-rate window ---------------------------------------------------------------


def test_error_rate_over_the_window() -> None:
    """3 failures among 10 outcomes is a rate of 0.3, counted over the window only."""
    errors = ErrorRateWindow(window=30.0, min_calls=5, threshold=0.5)
    assert errors.rate(0.0) == 0.0
    for i in range(10):
        errors.record(i >= 3 or i == 1, float(i))
    assert errors.count(10.0) == 10
    assert errors.failures(10.0) == 2
    errors.record(False, 10.0)
    assert errors.rate(10.0) == pytest.approx(3 / 11)
    assert errors.count(45.0) == 0
    assert errors.rate(45.0) == 0.0


def test_error_rate_old_outcomes_slide_out() -> None:
    """Failures from 20 s ago leave a 10 s window while newer successes stay."""
    errors = ErrorRateWindow(window=10.0, min_calls=1)
    for _ in range(5):
        errors.record(False, 100.0)
    for _ in range(5):
        errors.record(True, 115.0)
    assert errors.rate(115.0) == 0.0
    assert errors.count(115.0) == 5


def test_error_window_needs_min_calls_before_it_trips() -> None:
    """A 100% error rate on too few outcomes does not trip; reaching ``min_calls`` does."""
    errors = ErrorRateWindow(window=30.0, min_calls=20, threshold=0.5)
    for _ in range(19):
        errors.record(False, 0.0)
    assert errors.rate(0.0) == 1.0
    assert not errors.exceeded(0.0)
    errors.record(True, 0.0)
    assert errors.exceeded(0.0)


def test_error_window_trips_at_exactly_the_threshold() -> None:
    """A rate equal to the threshold trips it (resilience4j's reading)."""
    errors = ErrorRateWindow(min_calls=4, threshold=0.5)
    for ok in (True, True, False, False):
        errors.record(ok, 0.0)
    assert errors.exceeded(0.0)
    errors.record(True, 0.0)
    assert not errors.exceeded(0.0)


def test_error_window_describe() -> None:
    """``describe`` shows the rate, the sample count and when it would pause."""
    errors = ErrorRateWindow(window=30.0, threshold=0.5, min_calls=20)
    errors.record(False, 0.0)
    errors.record(True, 0.0)
    assert errors.describe(0.0) == "error rate 50% of 2 in 30s (pause at 50% with 20 or more)"
    assert repr(errors) == "ErrorRateWindow(window=30.0, threshold=0.5, min_calls=20)"


def test_a_clock_reading_from_the_past_counts_in_the_newest_bucket() -> None:
    """A stale ``now`` neither crashes nor rewrites history: it lands in the newest bucket."""
    errors = ErrorRateWindow(window=10.0, min_calls=1)
    errors.record(True, 100.0)
    errors.record(False, 50.0)
    assert errors.count(100.0) == 2
    assert errors.count(111.0) == 0


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf])
def test_a_now_that_is_not_a_reading_is_refused(now: float) -> None:
    """NaN or infinite times are bugs in the caller."""
    with pytest.raises(ValueError, match="now"):
        ErrorRateWindow().record(True, now)
    with pytest.raises(ValueError, match="now"):
        RetryBudget().deposit("q", now)


@settings(max_examples=100)
@given(
    times=st.lists(st.floats(min_value=0.0, max_value=10_000.0), max_size=300),
    window=st.floats(min_value=1.0, max_value=120.0),
)
def test_window_memory_is_bounded_by_its_span(times: list[float], window: float) -> None:
    """However many outcomes arrive, a window never holds more than ceil(window) buckets."""
    counts = SlidingCounts(window=window, resolution=1.0, fields=2)
    for now in sorted(times):
        counts.add(now, 0)
        assert counts.stored_buckets <= math.ceil(window) <= MAX_BUCKETS


@settings(max_examples=100)
@given(outcomes=st.lists(st.tuples(st.booleans(), st.floats(0.0, 5.0)), max_size=200))
def test_error_rate_is_a_share(outcomes: list[tuple[bool, float]]) -> None:
    """The rate is always in [0, 1] and failures never exceed the count."""
    errors = ErrorRateWindow(window=60.0, min_calls=1)
    now = 0.0
    for ok, gap in outcomes:
        now += gap
        errors.record(ok, now)
        assert 0.0 <= errors.rate(now) <= 1.0
        assert errors.failures(now) <= errors.count(now)


BAD_WINDOW_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"threshold": 0.0}, "threshold"),
    ({"threshold": 1.1}, "threshold"),
    ({"threshold": math.nan}, "threshold"),
    ({"min_calls": 0}, "min_calls"),
    ({"min_calls": 2.5}, "min_calls"),
    ({"window": -1.0}, "window"),
    ({"window": math.inf}, "window"),
    ({"resolution": -1.0}, "resolution"),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD_WINDOW_SETTINGS)
def test_a_bad_error_window_setting_is_a_config_error_naming_it(
    kwargs: dict[str, Any], name: str
) -> None:
    """Out-of-range error window parameters are refused by name."""
    with pytest.raises(ConfigError) as info:
        ErrorRateWindow(**kwargs)
    assert info.value.setting == name
