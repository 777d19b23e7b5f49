"""The core's rules about jobs, decided once for every store: what an outcome and a lost
lease do to a job, which refused renewal was stale, and which state moves exist."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline._errors import StoreError
from tokenline._jobs import (
    ALLOWED_TRANSITIONS,
    MAX_ERROR_LENGTH,
    Finish,
    JobState,
    Lease,
    Outcome,
    RescueCandidate,
    can_transition,
    error_text,
    finish_transition,
    renewal_was_stale,
    rescue_transition,
)
from tokenline.stores.memory.store import _moved

LEASE = Lease(1, "w", 3, 0.0)


@given(st.sampled_from(Outcome), st.none() | st.floats(min_value=0, max_value=1e6))
def test_every_outcome_moves_a_running_job_along_an_allowed_arrow(
    outcome: Outcome, delay: float | None
) -> None:
    """Whatever the outcome and delay, the target state is allowed from running; only a
    release gives the attempt back; only success and dead are final."""
    move = finish_transition(Finish(LEASE, outcome, delay))
    assert can_transition(JobState.RUNNING, move.state)
    assert move.refund == (1 if outcome is Outcome.RELEASE else 0)
    assert move.finished == (outcome in (Outcome.SUCCEEDED, Outcome.DEAD))
    if not move.finished:
        assert move.state is (JobState.SCHEDULED if (delay or 0) > 0 else JobState.QUEUED)


@given(st.integers(0, 10), st.integers(1, 10), st.integers(0, 10), st.integers(1, 10))
def test_a_lost_lease_never_burns_an_attempt_and_ends_at_its_own_limit(
    attempt: int, max_attempts: int, expiries: int, max_expiries: int
) -> None:
    """A rescue gives the attempt back; the job goes dead exactly when this expiry
    reaches max_lease_expiries, with a reason that says so."""
    rescue = rescue_transition(
        RescueCandidate(1, 3, "w", attempt, max_attempts, expiries, max_expiries)
    )
    move = rescue.transition
    assert move.refund == 1
    assert can_transition(JobState.RUNNING, move.state)
    dead = expiries + 1 >= max_expiries
    assert move.state is (JobState.DEAD if dead else JobState.QUEUED)
    assert ("lost its lease" in rescue.reason) == dead


@pytest.mark.parametrize(
    ("holder_token", "holder_owner", "stale"),
    [
        (None, None, False),  # no record of the lease: nothing to say
        (3, "w", False),  # still ours: it merely expired
        (3, None, False),  # its owner finished it
        (4, "other", True),  # taken over
        (3, "other", True),  # another owner, same number (a different counter)
        (4, None, True),  # rescued: a newer token
    ],
)
def test_a_refused_renewal_is_stale_only_when_someone_else_holds_the_lease(
    holder_token: int | None, holder_owner: str | None, stale: bool
) -> None:
    """The one rule every store records refused renewals by."""
    assert renewal_was_stale(holder_token, holder_owner, 3, "w") is stale


def test_the_reference_store_refuses_a_move_the_state_machine_forbids() -> None:
    """The in-memory store enforces ALLOWED_TRANSITIONS as the SQL triggers do: a
    succeeded job cannot be moved back to running."""
    from tokenline._jobs import Job

    job = Job(1, "q", "t", "[]", None, 0, 0.0, 1, 5, JobState.SUCCEEDED, None, 1, None,
              None, None, 0.0, 0.0, 0.0, None)  # fmt: skip
    with pytest.raises(StoreError, match="succeeded -> running"):
        _moved(job, state=JobState.RUNNING)
    assert ALLOWED_TRANSITIONS[JobState.SUCCEEDED] == frozenset()
    same = _moved(job, attempt=2)  # no state change: nothing to refuse
    assert (same.state, same.attempt) == (JobState.SUCCEEDED, 2)


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("plain text\nwith a newline", "plain text\nwith a newline"),
        ("ünïcode ✓", "ünïcode ✓"),
        ("a\x00b", "a\\x00b"),
        ("lone \udcff surrogate", "lone \\udcff surrogate"),
        ("a\\x00b", "a\\x00b"),  # an escape the user wrote stays as written
    ],
)
def test_error_text_escapes_what_a_store_cannot_keep_and_nothing_else(
    given: str, kept: str
) -> None:
    """NUL and lone surrogates become escapes; every other character is kept."""
    assert error_text(given) == kept
    assert error_text(given).encode("utf-8")  # encodable, whatever came in


def test_error_text_is_cut_to_its_limit_saying_how_long_it_was() -> None:
    """A long text keeps its start and says its length, within the limit."""
    cut = error_text("é" * (MAX_ERROR_LENGTH * 3))
    assert len(cut) == MAX_ERROR_LENGTH
    assert cut.startswith("éé")
    assert cut.endswith(f"… ({MAX_ERROR_LENGTH * 3} characters)")
    exact = "x" * MAX_ERROR_LENGTH
    assert error_text(exact) == exact


def test_every_finish_carries_an_error_text_a_store_can_keep() -> None:
    """Finish applies error_text itself: no path that ends an attempt can skip it."""
    lease = Lease(1, "w", 1, 0.0)
    assert Finish(lease, Outcome.DEAD, None, "a\x00b").error == "a\\x00b"
    assert Finish(lease, Outcome.SUCCEEDED).error is None
    assert Finish(lease, Outcome.RETRY, 1.0, 42).error == "42"  # type: ignore[arg-type]
