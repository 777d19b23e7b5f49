"""``prefetch = "auto"``: how many jobs a worker claims ahead of its handlers."""

from __future__ import annotations

import pytest

from tokenline.worker.prefetch import AUTO_MAX, AUTO_WAIT, RunTimes, auto_prefetch


def test_nothing_ahead_before_any_handler_returned() -> None:
    """With no run time known yet, a worker claims only for its free slots."""
    assert auto_prefetch(None, 1) == 0
    assert auto_prefetch(None, 8) == 0


@pytest.mark.parametrize(
    ("mean_run", "running", "ahead"),
    [
        (0.0, 1, AUTO_MAX - 1),  # a no-op handler
        (0.001, 1, AUTO_MAX - 1),  # 20 would fit in the wait; running + ahead is capped
        (0.002, 1, 10),
        (0.005, 1, 4),
        (AUTO_WAIT, 1, 1),  # exactly one fits
        (AUTO_WAIT * 1.01, 1, 0),  # none: it would wait longer than allowed
        (1.0, 1, 0),
        (0.05, 4, 1),  # four at once share the wait
        (0.0, 10, AUTO_MAX - 10),
    ],
)
def test_ahead_keeps_the_expected_wait_within_the_bound(
    mean_run: float, running: int, ahead: int
) -> None:
    """As many as keep ``ahead / running * mean_run`` within AUTO_WAIT, with running and
    prefetched together at most AUTO_MAX."""
    assert auto_prefetch(mean_run, running) == ahead
    assert ahead * mean_run / running <= AUTO_WAIT * (1 + 1e-9)
    assert running + ahead <= AUTO_MAX


@pytest.mark.parametrize("running", [AUTO_MAX, AUTO_MAX + 1, 50, 10_000])
def test_a_worker_running_many_at_once_prefetches_nothing(running: int) -> None:
    """Its handlers already overlap the store's round trips: prefetch would only cost."""
    assert auto_prefetch(0.0, running) == 0


def test_no_slot_no_prefetch() -> None:
    """A limit of 0 handlers (never configured, but the maths must not divide by it)."""
    assert auto_prefetch(0.001, 0) == 0


def test_run_times_follow_the_recent_handlers() -> None:
    """The first reading is the average; later ones move it a fifth of the way, so a
    single long job stops the prefetch for a while and short ones bring it back."""
    times = RunTimes()
    assert times.mean is None
    times.add(0.001)
    assert times.mean == pytest.approx(0.001)
    times.add(10.0)
    assert times.mean == pytest.approx(0.001 + 0.2 * (10.0 - 0.001))
    assert auto_prefetch(times.mean, 1) == 0
    for _ in range(60):
        times.add(0.001)
    assert auto_prefetch(times.mean, 1) == AUTO_MAX - 1


def test_a_clock_going_backwards_counts_as_no_time() -> None:
    """A negative reading (a clock stepped back) never makes the average negative."""
    times = RunTimes()
    times.add(-5.0)
    assert times.mean == 0.0
