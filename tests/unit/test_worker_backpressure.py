"""The worker slows down when jobs fail from overload: its adaptive concurrency limit,
its retry budget, and pausing consumption on a high error rate."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tokenline import (
    App,
    ConfigError,
    JobContext,
    JobState,
    Settings,
    Worker,
    WorkerSettings,
    WorkerState,
    events,
)
from tokenline.stores import Store
from unit.test_worker import FAST, NO_BACKOFF, eventually, running


def _app() -> tuple[App, Store]:
    app = App("memory://")
    return app, app.open_store()


async def test_timeouts_shrink_the_limit_and_successes_grow_it_back() -> None:
    """Jobs that hit their hard timeout halve the worker's concurrency limit (announced
    as an event); fast successes afterwards bring it back up."""
    app, store = _app()
    limits: list[tuple[int, int]] = []

    def hear(e: events.Event) -> None:
        if isinstance(e, events.ConcurrencyLimitChanged):
            limits.append((e.old, e.new))

    @app.task(name="t.bp_slow", timeout=0.05, max_attempts=1)
    async def slow(ctx: JobContext) -> None:
        await asyncio.sleep(5)

    @app.task(name="t.bp_fast")
    async def fast(ctx: JobContext) -> None:
        # Long enough that the slots fill: the limit grows only while it is in use.
        await asyncio.sleep(0.05)

    settings = dataclasses.replace(FAST, concurrency=8)
    worker = Worker(app, settings)
    events.add_hook(hear)
    try:
        async with running(worker):
            for _ in range(8):
                await app.enqueue_async("t.bp_slow", store=store)
            await eventually(lambda: worker.concurrency_limit < 8, "the limit to fall")
            assert limits[0][0] == 8
            assert limits[0][1] < 8
            for _ in range(200):
                await app.enqueue_async("t.bp_fast", store=store)
            await eventually(lambda: worker.concurrency_limit == 8, "the limit to grow back")
    finally:
        events.remove_hook(hear)


async def test_a_fixed_limit_does_not_move() -> None:
    """concurrency_control = fixed: timeouts leave the limit at concurrency."""
    app, store = _app()

    @app.task(name="t.bp_slow_fixed", timeout=0.05, max_attempts=1)
    async def slow(ctx: JobContext) -> None:
        await asyncio.sleep(5)

    settings = dataclasses.replace(FAST, concurrency=4, concurrency_control="fixed")
    worker = Worker(app, settings)
    ids = [await app.enqueue_async("t.bp_slow_fixed", store=store) for _ in range(6)]
    async with running(worker):
        for jid in ids:
            await eventually_dead(store, jid)
    assert worker.concurrency_limit == 4


async def eventually_dead(store: Store, jid: int) -> None:
    async def dead() -> bool:
        return (await store.job_get(job_id=jid)).state is JobState.DEAD

    deadline = time.monotonic() + 10
    while not await dead():
        assert time.monotonic() < deadline, f"job {jid} did not die"
        await asyncio.sleep(0.01)


async def test_retries_past_the_budget_wait_a_window() -> None:
    """With a budget of 0.2 retries per first attempt (and its small floor), most of a
    burst of failing jobs is not retried at once: their retries are pushed a whole
    window out, so a failing dependency does not get every retry immediately."""
    app, store = _app()

    @app.task(name="t.bp_fail", max_attempts=3, retry=NO_BACKOFF)
    async def fail(ctx: JobContext) -> None:
        raise ConnectionError("dependency down")

    # The budget alone: a fixed limit and no pause, so the burst is not slowed otherwise.
    settings = dataclasses.replace(
        FAST,
        retry_budget=0.2,
        retry_budget_window=600.0,
        pause_min_jobs=10_000,
        concurrency_control="fixed",
    )
    ids = [await app.enqueue_async("t.bp_fail", store=store) for _ in range(100)]
    async with running(Worker(app, settings)):

        async def all_tried() -> bool:
            jobs = [await store.job_get(job_id=j) for j in ids]
            return all(j.attempt >= 1 and j.state is not JobState.RUNNING for j in jobs)

        deadline = time.monotonic() + 60  # generous: a slow, shared machine
        while not await all_tried():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    jobs = [await store.job_get(job_id=j) for j in ids]
    now = time.time()
    held_back = [j for j in jobs if j.state is JobState.SCHEDULED and j.run_at > now + 300]
    # 100 first attempts buy 20 retries, plus the floor's 60 over 600 s: at most 80
    # run at once; the rest wait the window.
    assert len(held_back) >= 20, [(j.state, round(j.run_at - now)) for j in jobs]


async def test_a_high_error_rate_pauses_claiming_and_the_worker_resumes_by_itself() -> None:
    """Most recent jobs failing from overload: the worker goes DRAINING (claims
    nothing), and comes back to READY once the window has moved past the failures."""
    app, store = _app()

    @app.task(name="t.bp_storm", max_attempts=1)
    async def storm(ctx: JobContext) -> None:
        raise TimeoutError("dependency timed out")

    settings = dataclasses.replace(
        FAST, pause_error_rate=0.5, pause_window=1.0, pause_min_jobs=5, retry_budget=1.0
    )
    worker = Worker(app, settings)
    for _ in range(10):
        await app.enqueue_async("t.bp_storm", store=store)
    async with running(worker) as states:
        await eventually(lambda: WorkerState.DRAINING in states, "the worker to pause")
        await eventually(
            lambda: (
                states[-1] in (WorkerState.READY, WorkerState.PROCESSING)
                and WorkerState.DRAINING in states
            ),
            "the worker to resume",
        )
    i = states.index(WorkerState.DRAINING)
    assert WorkerState.READY in states[i:]


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("concurrency_control", "adaptive"),
        ("concurrency_floor", 0),
        ("concurrency_floor", 11),
        ("retry_budget", 0),
        ("retry_budget", 1.5),
        ("retry_budget_window", -1),
        ("pause_error_rate", 0),
        ("pause_error_rate", 2),
        ("pause_window", float("nan")),
        ("pause_min_jobs", 0),
    ],
)
def test_bad_backpressure_settings_are_refused_naming_them(setting: str, value: object) -> None:
    """Out of range, a floor above the ceiling (concurrency 10), an unknown control:
    a ConfigError that names the setting, before any worker starts."""
    with pytest.raises(ConfigError, match=setting):
        WorkerSettings(**{setting: value})  # type: ignore[arg-type]


async def test_a_timed_out_attempt_is_retried_by_the_tasks_own_policy() -> None:
    """A hard timeout is retried with the task's retry policy, like any transient error
    (not the app's default backoff of a second and more)."""
    # The app's own backoff is long: only the task's policy can retry within the test.
    app = App("memory://", settings=Settings(url="memory://", retry_base=60.0, retry_cap=60.0))
    store = app.open_store()
    attempts: list[int] = []

    @app.task(name="t.bp_to", timeout=0.05, max_attempts=3, retry=NO_BACKOFF)
    async def slow(ctx: JobContext) -> None:
        attempts.append(ctx.attempt)
        await asyncio.sleep(5)

    jid = await app.enqueue_async("t.bp_to", store=store)
    async with running(Worker(app, dataclasses.replace(FAST, concurrency_control="fixed"))):
        await eventually_dead(store, jid)
    assert attempts == [1, 2, 3]


@pytest.mark.parametrize("handler", ["sync", "async"])
async def test_pausing_on_the_error_rate_with_prefetched_jobs_strands_none(handler: str) -> None:
    """A handler returning while the worker had paused on its error rate started a
    prefetched job in DRAINING: the state machine refused it after the slot was counted
    running, so the job held its lease for as long as the worker lived without running
    (or the watchdog crashed and the worker exited). Now no job starts while the worker
    claims nothing; the waiting ones go back unrun, and every job ends."""
    app, store = _app()
    failures: list[BaseException] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: failures.append(context["exception"]))

    def flaky_sync(ctx: JobContext, n: int) -> None:
        time.sleep(0.002)
        if n % 10 < 7 and ctx.attempt < 3:
            raise RuntimeError("transient boom")

    async def flaky_async(ctx: JobContext, n: int) -> None:
        await asyncio.sleep(0.002)
        if n % 10 < 7 and ctx.attempt < 3:
            raise RuntimeError("transient boom")

    app.task(name="t.bp_flaky", max_attempts=100, retry=NO_BACKOFF)(
        flaky_sync if handler == "sync" else flaky_async
    )
    settings = dataclasses.replace(
        FAST,
        concurrency=4,
        prefetch=8,
        pause_error_rate=0.5,
        pause_window=1.0,
        pause_min_jobs=5,
        retry_budget=1.0,
        retry_budget_window=1.0,
    )
    worker = Worker(app, settings)
    ids = [await app.enqueue_async("t.bp_flaky", n, store=store) for n in range(30)]
    async with running(worker) as states:
        await eventually(lambda: WorkerState.DRAINING in states, "the worker to pause")

        async def all_ended() -> bool:
            jobs = [await store.job_get(job_id=i) for i in ids]
            return all(j.state is JobState.SUCCEEDED for j in jobs)

        # Paused a window at a time while failures dominate: longer than one wait.
        async with asyncio.timeout(90):
            while not await all_ended():
                assert worker.state is not WorkerState.STOPPED, failures
                await asyncio.sleep(0.05)
    assert failures == []
    assert WorkerState.STOPPED in states
    jobs = [await store.job_get(job_id=i) for i in ids]
    assert all(j.lease_expiries == 0 for j in jobs), [(j.id, j.lease_expiries) for j in jobs]
