"""The hard timeouts of async handlers, one timer per length of timeout (deadlines.py):
the same cancellations as ``asyncio.timeout``, for less."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tokenline.worker.deadlines import Deadlines


async def _attempt(deadlines: Deadlines, limit: float, seconds: float) -> str:
    """Sleep ``seconds`` under a deadline of ``limit``: what asyncio.timeout would say."""
    task = asyncio.current_task()
    assert task is not None
    deadline = deadlines.start(limit, task)
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if deadline.settle(cancelled=True):
            return "timed out"
        raise
    deadline.settle(cancelled=False)
    return "done"


async def test_only_the_attempts_past_their_deadline_are_cancelled() -> None:
    """Short attempts end in time, long ones are cancelled at their deadline, each
    length of timeout on its own; a cancellation taken back leaves the task as it was."""
    deadlines = Deadlines(asyncio.get_running_loop())
    runs = [
        asyncio.create_task(_attempt(deadlines, limit, seconds))
        for limit, seconds in [(0.2, 0.0), (0.2, 30), (5.0, 0.3), (0.4, 30), (0.2, 0.01)]
    ]
    results = await asyncio.wait_for(asyncio.gather(*runs), 20)
    assert results == ["done", "timed out", "done", "timed out", "done"]
    assert all(r.cancelling() == 0 for r in runs)
    assert deadlines.queued() == 0


async def test_a_cancellation_from_elsewhere_is_not_taken_for_the_deadline() -> None:
    """Cancelled by its worker (fenced, stopping) before its deadline: the attempt ends
    cancelled, not timed out, and its deadline never fires."""
    deadlines = Deadlines(asyncio.get_running_loop())
    run = asyncio.create_task(_attempt(deadlines, 0.3, 30))
    await asyncio.sleep(0.05)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await asyncio.sleep(0.5)
    assert deadlines.queued() == 0


async def test_an_attempt_that_swallows_its_timeout_is_told_it_ran_late() -> None:
    """As with asyncio.timeout: the deadline's cancellation is taken back and settle
    says the deadline passed, so the worker fails the attempt all the same."""
    deadlines = Deadlines(asyncio.get_running_loop())

    async def stubborn() -> bool:
        task = asyncio.current_task()
        assert task is not None
        deadline = deadlines.start(0.05, task)
        with contextlib.suppress(asyncio.CancelledError):  # swallowed
            await asyncio.sleep(30)
        late = deadline.settle(cancelled=False)
        assert task.cancelling() == 0
        return late

    assert await asyncio.wait_for(stubborn(), 20) is True


async def test_ended_attempts_do_not_pile_up_behind_a_long_one() -> None:
    """One attempt that runs for long heads its queue; the thousands that end behind it
    are dropped as the queue grows, so it stays the size of what is still running."""
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    task = asyncio.current_task()
    assert task is not None
    long = deadlines.start(300.0, task)
    for _ in range(10_000):
        deadlines.start(300.0, task).settle(cancelled=False)
    assert deadlines.queued() <= 2 * 1 + 64 + 1
    long.settle(cancelled=False)
    assert deadlines.queued() == 0
