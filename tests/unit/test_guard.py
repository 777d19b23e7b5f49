"""The guard around async handlers (``worker/guard.py``), with a fake predicate.

Each coroutine runs in a task of its own, as a handler does in the worker; the tests
control its steps with futures they resolve themselves, never with timing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenline.worker.guard import Guarded


class Gate:
    """A fake predicate: lets steps through until closed, and counts how often it is asked."""

    def __init__(self, open_: bool = True) -> None:
        self.open = open_
        self.asked = 0

    def __call__(self) -> str | None:
        self.asked += 1
        return None if self.open else "gate closed"


async def guarded(coro: Any, gate: Gate) -> Any:
    """Await ``coro`` through the guard (from a task, as the worker does)."""
    return await Guarded(coro, gate)


async def test_no_statement_after_the_await_runs_once_the_predicate_says_stop() -> None:
    """A coroutine whose predicate turns to "stop" while it waits gets CancelledError at that
    await, with the predicate's reason, and the statement after it never runs."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[int] = loop.create_future()
    steps: list[str] = []

    async def handler() -> None:
        steps.append("before")
        try:
            await ready
        except asyncio.CancelledError as exc:
            steps.append(f"cancelled: {exc}")
            raise
        steps.append("after")

    gate = Gate()
    task = asyncio.create_task(guarded(handler(), gate))
    await asyncio.sleep(0)
    assert steps == ["before"]
    gate.open = False
    ready.set_result(1)  # the handler is due to resume, but it may no longer run
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["before", "cancelled: gate closed"]


async def test_the_first_step_is_guarded_too() -> None:
    """A predicate saying "stop" before the first step keeps the whole body from running."""
    ran: list[str] = []

    async def handler() -> None:
        ran.append("body")

    coro = handler()
    with pytest.raises(asyncio.CancelledError, match="gate closed"):
        await asyncio.create_task(guarded(coro, Gate(open_=False)))
    assert ran == []
    assert coro.cr_frame is None  # finished: no "never awaited" warning either


async def test_the_predicate_is_asked_before_every_resumption() -> None:
    """The predicate is asked once per step: before the first, and after each await."""
    gate = Gate()

    async def handler() -> None:
        for _ in range(3):
            await asyncio.sleep(0)

    await asyncio.create_task(guarded(handler(), gate))
    assert gate.asked == 4


@pytest.mark.parametrize("resolved", [False, True], ids=["waiting", "due"])
async def test_real_cancellation_is_forwarded_into_the_coroutine(resolved: bool) -> None:
    """task.cancel() reaches the coroutine at its await with its message, whether what it
    awaited is still pending or already resolved, and the task ends cancelled."""
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def handler() -> None:
        try:
            await ready
        except asyncio.CancelledError as exc:
            seen.append(str(exc))
            raise
        seen.append("after")

    task = asyncio.create_task(guarded(handler(), Gate()))
    await asyncio.sleep(0)
    if resolved:
        ready.set_result(1)  # due to resume: only the cancellation thrown in can stop it
    task.cancel("stop now")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert seen == ["stop now"]


async def test_values_in_and_out_and_exceptions_pass_through() -> None:
    """What the awaited futures resolve to reaches the coroutine, its return value reaches the
    awaiter, and an exception it raises comes out unchanged."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    loop.call_soon(fut.set_result, 20)

    async def adds() -> int:
        await asyncio.sleep(0)
        return await fut + 22

    boom = ValueError("boom")

    async def fails() -> None:
        await asyncio.sleep(0)
        raise boom

    assert await asyncio.create_task(guarded(adds(), Gate())) == 42
    with pytest.raises(ValueError, match="boom") as info:
        await asyncio.create_task(guarded(fails(), Gate()))
    assert info.value is boom


async def test_an_abandoned_wrapper_closes_the_coroutine() -> None:
    """Closing the wrapper mid-await closes the handler's coroutine: its finally runs."""
    cleaned: list[str] = []

    async def handler() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append("closed")

    coro = handler()  # held here, so that only an explicit close() can run its finally
    steps = Guarded(coro, Gate()).__await__()
    pending = steps.send(None)  # the first step runs up to the sleep
    assert isinstance(pending, asyncio.Future)
    steps.close()
    assert cleaned == ["closed"]
    assert coro.cr_frame is None


@pytest.mark.parametrize("cleanup", ["sync", "awaits"])
async def test_a_coroutine_that_ignores_cancellation_is_closed_once_abandoned(
    cleanup: str,
) -> None:
    """A coroutine that catches every CancelledError would run for as long as it likes;
    once ``abandon()`` says so, the next cancellation closes it where it waits (its
    finally runs, up to a first await) and the wrapper raises CancelledError."""
    abandoned = False
    cancels: list[int] = []
    cleaned: list[str] = []

    async def handler() -> None:
        try:
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    cancels.append(1)  # and carries on
        finally:
            cleaned.append("finally")
            if cleanup == "awaits":
                await asyncio.sleep(0)  # not allowed while closing: cut short here
                cleaned.append("after an await in finally")

    async def run() -> None:
        await Guarded(handler(), Gate(), lambda: abandoned)

    task = asyncio.create_task(run())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()  # it caught the cancellation and waits again
    assert cancels == [1]
    abandoned = True
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancels == [1]  # the second cancellation never reached it
    assert cleaned == ["finally"]


async def test_a_step_that_holds_the_loop_past_the_threshold_is_reported() -> None:
    """Each step is timed by the watch's clock; one that took the threshold or longer
    is reported with its duration, the others are not. The last step (the return) and a
    step that raises are timed too."""
    from tokenline.worker.guard import StepWatch

    now = [0.0]
    held: list[float] = []
    watch = StepWatch(1.0, lambda: now[0], held.append)

    async def handler() -> str:
        now[0] += 0.5  # short: not reported
        await asyncio.sleep(0)
        now[0] += 2.0  # held the loop: reported
        await asyncio.sleep(0)
        now[0] += 1.0  # exactly the threshold, in the step that returns
        return "done"

    async def through(coro: Any) -> Any:
        return await Guarded(coro, Gate(), watch=watch)

    assert await asyncio.create_task(through(handler())) == "done"
    assert held == [2.0, 1.0]

    async def failing() -> None:
        now[0] += 3.0
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await asyncio.create_task(through(failing()))
    assert held == [2.0, 1.0, 3.0]
