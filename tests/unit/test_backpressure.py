"""Backpressure pieces on a fake clock."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline import ConfigError
from tokenline.backpressure import (
    ErrorRateWindow,
    RetryBudget,
)
from tokenline.backpressure._window import MAX_BUCKETS, SlidingCounts

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
