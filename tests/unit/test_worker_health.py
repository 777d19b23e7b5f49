"""A worker's liveness and readiness, as its health endpoints report them."""

from __future__ import annotations

import asyncio

from tokenline import App, FakeClock, JobContext, JobState, Worker, WorkerState
from tokenline.stores import MemoryStore
from unit.test_worker import FAST, eventually, running


async def test_ready_while_working_not_ready_once_draining_and_dead_once_stopped() -> None:
    """Before start: alive but not ready. Running: ready. Draining: alive, not ready
    (an orchestrator stops sending it work, and does not kill it). Stopped: not alive."""
    app = App("memory://")
    worker = Worker(app, FAST)
    assert worker.liveness() == (True, "ok")
    assert worker.readiness()[0] is False
    async with running(worker):
        await eventually(lambda: worker.readiness()[0], "the worker is ready")
        assert worker.liveness() == (True, "ok")
        worker.request_shutdown()
        await eventually(lambda: worker.state is not WorkerState.READY, "draining")
        ready, why = worker.readiness()
        assert ready is False
        assert why.startswith("state ")
    assert worker.liveness() == (False, "stopped")


async def test_not_ready_without_an_accepted_heartbeat_but_still_alive() -> None:
    """A worker whose store stops answering loses readiness after a lease TTL without
    an accepted heartbeat, but stays alive: a store outage must not get healthy
    workers restarted."""
    clock = FakeClock()
    app = App("memory://", clock=clock)
    worker = Worker(app, FAST, store=MemoryStore(clock=clock))
    async with running(worker):
        await eventually(lambda: worker.readiness()[0], "the worker is ready")
        clock.advance(FAST.lease_ttl + 1)  # no heartbeat can land in between: fake time
        ready, why = worker.readiness()
        assert ready is False
        assert "no heartbeat accepted" in why
        # The loop keeps turning (the watchdog ticks on real time): alive throughout.
        await eventually(lambda: worker.liveness() == (True, "ok"), "alive")


async def test_an_operators_drain_request_drains_then_stops_the_worker() -> None:
    """`tokenline drain` marks the worker's membership; at its next heartbeat the worker
    claims nothing more, finishes the job in flight and stops."""
    app = App("memory://")
    store = app.open_store()
    release = asyncio.Event()
    done: list[int] = []

    @app.task(name="t.drain_me")
    async def job(ctx: JobContext) -> None:
        await release.wait()
        done.append(ctx.job_id)

    first = await app.enqueue_async("t.drain_me", store=store)
    worker = Worker(app, FAST)
    async with running(worker) as states:
        await eventually(lambda: WorkerState.PROCESSING in states, "the job to start")
        assert await store.worker_drain(worker_id=worker.id) is True
        await eventually(lambda: WorkerState.DRAINING in states, "the worker to drain")
        second = await app.enqueue_async("t.drain_me", store=store)
        release.set()
        await eventually(lambda: worker.state is WorkerState.STOPPED, "the worker to stop")
    assert done == [first]
    assert (await store.job_get(job_id=second)).state is JobState.QUEUED
