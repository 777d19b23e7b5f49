"""Retry delays: capped exponential bound, full jitter, validated policy."""

from __future__ import annotations

import logging
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline import MAX_DELAY, ConfigError, RetryPolicy
from tokenline.retry import policy_delay


def test_bound_doubles_from_base_until_the_cap() -> None:
    """The bound is base, 2*base, 4*base, ... and then stays at the cap."""
    policy = RetryPolicy(base=1.0, cap=10.0)
    assert [policy.bound(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_bound_of_first_attempt_is_base() -> None:
    """After the first attempt the delay bound is exactly the base."""
    assert RetryPolicy(base=0.25, cap=300.0).bound(1) == 0.25


@pytest.mark.parametrize("attempt", [64, 65, 1_000, 10_000, 10**9])
def test_bound_never_exceeds_cap_for_huge_attempts(attempt: int) -> None:
    """Huge attempt numbers give the cap, without OverflowError or infinity."""
    policy = RetryPolicy(base=1.0, cap=300.0)
    bound = policy.bound(attempt)
    assert bound == 300.0
    assert math.isfinite(bound)


def test_bound_is_a_float() -> None:
    """The bound is a float even when base and cap are given as ints."""
    assert isinstance(RetryPolicy(base=1, cap=4).bound(5), float)


@given(
    base=st.floats(min_value=1e-3, max_value=100.0),
    extra=st.floats(min_value=0.0, max_value=10_000.0),
    attempt=st.integers(min_value=1, max_value=20_000),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_delay_lies_between_zero_and_the_bound(
    base: float, extra: float, attempt: int, seed: int
) -> None:
    """Every jittered delay lies in [0, bound(attempt)], and the bound in [base, cap]."""
    policy = RetryPolicy(base=base, cap=base + extra)
    bound = policy.bound(attempt)
    assert base <= bound <= policy.cap
    delay = policy.delay(attempt, random.Random(seed))
    assert 0.0 <= delay <= bound


@given(attempt=st.integers(min_value=1, max_value=100))
def test_bound_is_monotonic_in_attempt(attempt: int) -> None:
    """A later attempt never gets a smaller bound than an earlier one."""
    policy = RetryPolicy(base=0.5, cap=120.0)
    assert policy.bound(attempt + 1) >= policy.bound(attempt)


def test_delay_is_reproducible_with_a_seeded_rng() -> None:
    """The same seed gives the same delay: the jitter comes only from the given rng."""
    policy = RetryPolicy(base=1.0, cap=300.0)
    assert policy.delay(5, random.Random(7)) == policy.delay(5, random.Random(7))


def test_delay_is_jittered_not_constant() -> None:
    """Delays for one attempt spread over the range instead of all equalling the bound."""
    policy = RetryPolicy(base=1.0, cap=300.0)
    rng = random.Random(1234)
    delays = {policy.delay(6, rng) for _ in range(50)}
    assert len(delays) > 40
    assert min(delays) < policy.bound(6) / 2 < max(delays)


@pytest.mark.parametrize("base", [0.0, -1.0, math.nan])
def test_non_positive_base_is_a_config_error(base: float) -> None:
    """A base that is not > 0 (including NaN) raises ConfigError naming retry_base."""
    with pytest.raises(ConfigError) as info:
        RetryPolicy(base=base, cap=10.0)
    assert info.value.setting == "retry_base"


@pytest.mark.parametrize("cap", [0.5, math.nan])
def test_cap_below_base_is_a_config_error(cap: float) -> None:
    """A cap smaller than the base (or NaN) raises ConfigError naming retry_cap."""
    with pytest.raises(ConfigError) as info:
        RetryPolicy(base=1.0, cap=cap)
    assert info.value.setting == "retry_cap"


@pytest.mark.parametrize("attempt", [0, -1, -100])
def test_attempt_below_one_is_rejected(attempt: int) -> None:
    """Attempts are 1-based: bound() and delay() refuse attempt < 1."""
    policy = RetryPolicy()
    with pytest.raises(ValueError, match="1-based"):
        policy.bound(attempt)
    with pytest.raises(ValueError, match="1-based"):
        policy.delay(attempt, random.Random(0))


@pytest.mark.parametrize(
    ("setting", "base", "cap"),
    [
        ("retry_base", "soon", 10.0),
        ("retry_base", True, 10.0),
        ("retry_base", math.inf, math.inf),
        ("retry_base", 10**400, 10**400),
        ("retry_cap", 1.0, math.inf),
        ("retry_cap", 1.0, "300"),
        ("retry_cap", 1.0, MAX_DELAY + 1),
    ],
)
def test_policy_durations_are_checked_like_enqueue_delays(
    setting: str, base: object, cap: object
) -> None:
    """base and cap are numbers of seconds up to MAX_DELAY: a string, a bool, infinity
    or a huge integer is a ConfigError naming it, not a TypeError or OverflowError at
    the first retry."""
    with pytest.raises(ConfigError) as info:
        RetryPolicy(base=base, cap=cap)  # type: ignore[arg-type]
    assert info.value.setting == setting


class _Answers(RetryPolicy):
    """A policy whose delay() answers whatever it is given."""

    def __init__(self, answer: object) -> None:
        object.__setattr__(self, "base", 1.0)
        object.__setattr__(self, "cap", 1.0)
        object.__setattr__(self, "_answer", answer)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        if isinstance(self._answer, Exception):
            raise self._answer
        return self._answer  # type: ignore[return-value]


@pytest.mark.parametrize("answer", ["soon", math.nan, -1.0, 10**400, ZeroDivisionError("bug")])
def test_a_policy_answering_no_valid_delay_is_logged_and_the_default_decides(
    answer: object, caplog: pytest.LogCaptureFixture
) -> None:
    """What the worker asks: a bad answer (or an exception) from a policy's delay()
    is an error in the log, and the default backoff's delay is used instead."""
    with caplog.at_level(logging.ERROR, logger="tokenline.worker"):
        delay = policy_delay(_Answers(answer), 1)
    assert 0.0 <= delay <= RetryPolicy().bound(1)
    (record,) = caplog.records
    assert "retry policy" in record.getMessage()
    assert "default backoff decides" in record.getMessage()


def test_a_valid_policy_delay_is_used() -> None:
    """A good answer is passed through."""
    assert policy_delay(_Answers(2.5), 1) == 2.5
