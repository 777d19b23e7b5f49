"""A drain timeout never cuts ``ctx.effect`` mid-call.

One SIGTERM whose drain timed out while a handler ran an effect's callee ended the
callee there: the process exited under a sync handler's thread, the cancellation cut an
async handler's awaited call. The key stayed pending (or was recorded failed), and the
job's next attempt ran the callee again: an orderly stop did what a crash does. The
drain now waits for each effect under way, its lease renewed meanwhile, then gives the
job back, and the next attempt finds the key done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pytest

from tokenline import App, JobContext, JobState, RetryPolicy, Worker, WorkerSettings
from tokenline._jobs import Lease
from tokenline._records import EffectBegin, EffectStatus
from tokenline.stores import MemoryStore, Store
from tokenline.stores._repairs import RERUN
from tokenline.worker.slot import Slot

#: Deadline for anything a test waits on; a healthy run takes a small fraction of it.
DEADLINE = 10.0

#: A lease shorter than the effects below: kept only if the drain renews it. The
#: worker's own rescuer runs every 0.1 s, and would take an expired job back.
DRAINING = WorkerSettings(
    lease_ttl=0.6,
    renew_interval=0.15,
    poll_interval=0.02,
    rescue_interval=0.1,
    concurrency=1,
    drain_timeout=0.2,
)

#: How long each callee runs: past the drain timeout and past the lease TTL.
CALLEE_SECONDS = 1.0

#: Retries come back at once.
NO_BACKOFF = RetryPolicy(base=0.001, cap=0.001)


def _sabotage(monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    """The control: the worker never sees a handler inside an effect."""
    monkeypatch.setattr(Slot, field, property(lambda s: None, lambda s, v: None))


async def _stop_during_the_effect(worker: Worker, started: threading.Event) -> asyncio.Task[Any]:
    """Start ``worker``, wait for the callee to start, ask for one stop (a SIGTERM)."""
    task = asyncio.create_task(worker.run())
    await asyncio.to_thread(started.wait, DEADLINE)
    worker.request_shutdown()
    return task


async def _run_to_success(app: App, store: Store, job_id: int) -> None:
    """Run another worker until ``job_id`` has succeeded."""
    worker = Worker(app, dataclasses.replace(DRAINING, drain_timeout=5.0), store=store)
    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(DEADLINE):
            # Polling: the store exposes no event for a job's state.
            while (await store.job_get(job_id=job_id)).state is not JobState.SUCCEEDED:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)


@pytest.mark.parametrize("spare", ["on", "sabotaged"])
async def test_a_drain_timeout_waits_for_a_sync_effect_then_gives_its_job_back(
    monkeypatch: pytest.MonkeyPatch, spare: str
) -> None:
    if spare == "sabotaged":
        _sabotage(monkeypatch, "effect_key")
    app = App("memory://")
    store = app.open_store()
    started = threading.Event()
    runs: list[float] = []

    def charge() -> str:
        started.set()
        time.sleep(CALLEE_SECONDS)
        runs.append(time.monotonic())
        return "charged"

    @app.task(name="t.pay")
    def pay(ctx: JobContext) -> None:
        ctx.effect("charge:1", charge)

    jid = await app.enqueue_async("t.pay", store=store)
    worker = Worker(app, DRAINING, store=store)
    await asyncio.wait_for(await _stop_during_the_effect(worker, started), DEADLINE)
    ran_before_the_stop = len(runs)
    if spare == "sabotaged":
        # Stopped mid-call: a worker process exits here, ending the thread's callee.
        assert ran_before_the_stop == 0
        await asyncio.sleep(CALLEE_SECONDS)  # the thread's callee ends meanwhile
        return
    assert ran_before_the_stop == 1
    (record,) = await store.effects_list(key="charge:1")
    assert (record.status, record.runs) == (EffectStatus.COMPLETED, 1)
    job = await store.job_get(job_id=jid)
    assert job.state is JobState.QUEUED  # given back once the effect was over
    await _run_to_success(app, store, jid)
    assert len(runs) == 1  # the next attempt found the key done
    (record,) = await store.effects_list(key="charge:1")
    assert record.runs == 1


@pytest.mark.parametrize("spare", ["on", "sabotaged"])
async def test_a_drain_timeout_lets_an_async_effect_finish_then_gives_its_job_back(
    monkeypatch: pytest.MonkeyPatch, spare: str
) -> None:
    if spare == "sabotaged":
        _sabotage(monkeypatch, "effect_awaited")
    app = App("memory://")
    store = app.open_store()
    started = threading.Event()
    runs: list[float] = []

    async def charge() -> str:
        started.set()
        await asyncio.sleep(CALLEE_SECONDS)
        runs.append(time.monotonic())
        return "charged"

    @app.task(name="t.pay_async")
    async def pay(ctx: JobContext) -> None:
        await ctx.effect("charge:2", charge)

    jid = await app.enqueue_async("t.pay_async", store=store)
    worker = Worker(app, DRAINING, store=store)
    await asyncio.wait_for(await _stop_during_the_effect(worker, started), DEADLINE)
    (record,) = await store.effects_list(key="charge:2")
    if spare == "sabotaged":
        # Cancelled mid-call: its outcome unknown, the key left pending, for the next
        # attempt to take over and run again.
        assert runs == []
        assert record.status is EffectStatus.PENDING
        return
    assert len(runs) == 1
    assert (record.status, record.runs) == (EffectStatus.COMPLETED, 1)
    assert (await store.job_get(job_id=jid)).state is JobState.QUEUED
    await _run_to_success(app, store, jid)
    assert len(runs) == 1


@pytest.mark.parametrize("spare", ["on", "sabotaged"])
async def test_a_second_stop_while_the_drain_waits_for_an_effect_stops_at_once(
    monkeypatch: pytest.MonkeyPatch, spare: str
) -> None:
    """A second SIGTERM still means now: the worker stops, and the job, whose thread
    still runs the callee, is left to its lease (the key pending under it), never
    given back: its next attempt would take the key over while the callee runs here."""
    if spare == "sabotaged":
        _sabotage(monkeypatch, "effect_key")
    app = App("memory://")
    store = app.open_store()
    started, release = threading.Event(), threading.Event()

    def charge() -> str:
        started.set()
        release.wait(DEADLINE)
        return "charged"

    @app.task(name="t.pay_forced")
    def pay(ctx: JobContext) -> None:
        ctx.effect("charge:3", charge)

    jid = await app.enqueue_async("t.pay_forced", store=store)
    worker = Worker(app, DRAINING, store=store)
    try:
        task = await _stop_during_the_effect(worker, started)
        # Past the drain timeout, waiting for the effect: the worker has not stopped.
        await asyncio.sleep(DRAINING.drain_timeout + 0.3)
        if spare == "sabotaged":
            assert task.done()  # it stopped at the drain timeout, and gave the job back
            assert (await store.job_get(job_id=jid)).state is JobState.QUEUED
            return
        assert not task.done()
        worker.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)
        job = await store.job_get(job_id=jid)
        assert job.state is JobState.RUNNING  # left to its lease, never given back
        (record,) = await store.effects_list(key="charge:3")
        assert record.status is EffectStatus.PENDING
    finally:
        release.set()


class _SlowClaimAnswer(MemoryStore):
    """Takes an effect's key at once, and answers only once ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = asyncio.Event()
        self.answer = asyncio.Event()

    async def effect_begin(self, *, lease: Lease, key: str) -> EffectBegin:
        begin = await super().effect_begin(lease=lease, key=key)
        self.taken.set()
        await self.answer.wait()
        return begin


@pytest.mark.parametrize("marked", ["from the claim", "sabotaged"])
async def test_a_drain_timeout_during_an_effects_claim_never_runs_the_callee_twice(
    monkeypatch: pytest.MonkeyPatch, marked: str
) -> None:
    """The drain timeout came after the store took the key for the attempt, before the
    handler's thread had its answer: the worker did not yet see an effect under way,
    gave the job back, and the thread then ran the callee beside the next attempt,
    which took the key over. The effect is now marked from its claim on: the drain
    waits for the answer, and the callee, its attempt ended, never starts."""
    store = _SlowClaimAnswer()
    app = App("memory://")
    runs: list[int] = []

    def charge(token: int) -> str:
        runs.append(token)
        time.sleep(0.5)  # a stale run would still be under way when the next one starts
        return "charged"

    @app.task(name="t.pay_claimed")
    def pay(ctx: JobContext) -> None:
        ctx.effect("charge:4", charge, ctx.token)

    if marked == "sabotaged":
        # The control, as before: no effect seen while its claim is under way, and the
        # callee started whatever became of the attempt meanwhile.
        from tokenline.effects import EffectRun

        monkeypatch.setattr(JobContext, "_unless_stopped_while_claiming", lambda self: None)

        claim = EffectRun.claim

        async def unmarked_claim(self: EffectRun) -> Any:
            slots = list(worker._slots.values())
            for slot in slots:
                slot.effect_key = None
            begin = await claim(self)
            for slot in slots:
                slot.effect_key = self.key
            return begin

        monkeypatch.setattr(EffectRun, "claim", unmarked_claim)
    jid = await app.enqueue_async("t.pay_claimed", store=store)
    worker = Worker(app, DRAINING, store=store)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(store.taken.wait(), DEADLINE)
    worker.request_shutdown()
    await asyncio.sleep(DRAINING.drain_timeout + 0.2)  # the drain times out meanwhile
    store.answer.set()
    await asyncio.wait_for(task, DEADLINE)
    await _run_to_success(app, store, jid)
    await asyncio.sleep(0.1)  # a thread left running would have called by now
    if marked == "sabotaged":
        assert len(runs) == 2, runs  # the stopped attempt's thread, and the next attempt
        return
    assert len(runs) == 1, runs  # the next attempt's alone
    (record,) = await store.effects_list(key="charge:4")
    assert (record.status, record.runs) == (EffectStatus.COMPLETED, 2)


@pytest.mark.parametrize("record", ["left pending", "sabotaged"])
async def test_an_async_callee_cancelled_mid_call_is_rerun_as_such(
    monkeypatch: pytest.MonkeyPatch, record: str
) -> None:
    """An async callee cancelled by its handler's hard timeout was recorded failed, as
    if it had raised: the next attempt ran the key again at once, while the call it had
    handed to a thread still ran, and no audit listed the second run. A cancelled call
    has an unknown outcome: the key stays pending, and the next attempt's run of it is
    recorded as a rerun."""
    if record == "sabotaged":  # the control: a cancellation recorded as a failure
        import tokenline.effects as effects

        called = effects.call_claimed

        async def failed_on_cancel(run: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await called(run, fn, *args, **kwargs)
            except asyncio.CancelledError as exc:
                await effects.record_failure(run, exc)
                raise

        monkeypatch.setattr("tokenline.worker.context.call_claimed", failed_on_cancel)
    app = App("memory://")
    store = app.open_store()
    tokens: list[int] = []

    async def charge(token: int) -> str:
        tokens.append(token)
        if len(tokens) == 1:
            await asyncio.sleep(DEADLINE)  # cut by the hard timeout
        return "charged"

    @app.task(name="t.pay_cut", timeout=0.3, retry=NO_BACKOFF)
    async def pay(ctx: JobContext) -> None:
        await ctx.effect("charge:5", charge, ctx.token)

    jid = await app.enqueue_async("t.pay_cut", store=store)
    worker = Worker(app, DRAINING, store=store)
    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(DEADLINE):
            while (await store.job_get(job_id=jid)).state is not JobState.SUCCEEDED:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)
    assert len(tokens) == 2
    reruns = [d for d in await store.duplicates_list() if d.operation == RERUN]
    if record == "sabotaged":
        assert reruns == []  # run again, and listed nowhere
        return
    assert [(d.key, d.token) for d in reruns] == [("charge:5", tokens[1])]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_drain_timeout_gives_back_a_job_waiting_for_another_attempts_key(
    kind: str,
) -> None:
    """A job waiting for a key another live attempt held, at its worker's drain
    timeout, was kept waiting past effect_pending_deadline and then left to its lease,
    charged a lease expiry, though its callee never started. It now stops waiting at
    the drain timeout, having taken nothing, and is given back."""
    app = App("memory://")
    store = app.open_store()
    holding, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def hold() -> str:
        holding.set()
        release.wait(DEADLINE)
        runs.append("holder")
        return "held"

    def second() -> str:
        runs.append("waiter")
        return "never"

    @app.task(name="t.hold")
    def holder(ctx: JobContext) -> None:
        ctx.effect("shared", hold)

    if kind == "sync":

        @app.task(name="t.wait")
        def waiter(ctx: JobContext) -> None:
            ctx.effect("shared", second, wait=DEADLINE)

    else:

        @app.task(name="t.wait")
        async def waiter_async(ctx: JobContext) -> None:
            await ctx.effect("shared", second, wait=DEADLINE)

    first = Worker(app, dataclasses.replace(DRAINING, drain_timeout=30.0), store=store)
    holding_task = asyncio.create_task(first.run())
    try:
        await app.enqueue_async("t.hold", store=store)
        await asyncio.to_thread(holding.wait, DEADLINE)
        jid = await app.enqueue_async("t.wait", store=store)
        draining = Worker(
            app, dataclasses.replace(DRAINING, effect_pending_deadline=1.0), store=store
        )
        task = asyncio.create_task(draining.run())
        async with asyncio.timeout(DEADLINE):
            while (await store.job_get(job_id=jid)).state is not JobState.RUNNING:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        began = time.monotonic()
        draining.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)
        took = time.monotonic() - began
        job = await store.job_get(job_id=jid)
        assert job.state is JobState.QUEUED  # given back
        assert job.lease_expiries == 0
        assert draining.counters.lapsed == 0
        assert took < DRAINING.drain_timeout + 0.9  # not the 1 s deadline and more
    finally:
        release.set()
        first.request_shutdown()
        await asyncio.wait_for(holding_task, DEADLINE)
    assert runs == ["holder"]


def test_a_thread_that_outlives_its_workers_loop_is_told_the_attempt_is_over() -> None:
    """A sync handler's thread that ran on after its worker stopped (a callee released
    later) handed the record of its effect to a closed event loop: the driver's
    RuntimeError, and the record's coroutine reported as never awaited. It is now told
    its attempt is over, and the coroutine is closed."""
    import gc
    import types
    import warnings

    from tokenline import JobCancelled

    loop = asyncio.new_event_loop()
    loop.close()

    async def record() -> None:
        """Never to run: the loop is closed."""

    ctx = types.SimpleNamespace(_loop=loop, job_id=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(JobCancelled, match="job 7: its worker has stopped"):
            JobContext.run_sync(ctx, record(), "await ...")  # type: ignore[arg-type]
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
