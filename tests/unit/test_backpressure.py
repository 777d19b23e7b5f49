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
)
from tokenline.backpressure._window import MAX_BUCKETS, SlidingCounts

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
