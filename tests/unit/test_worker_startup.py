"""A starting worker whose store does not answer: ``startup_wait`` keeps it trying, for a
bounded time, only while the store is unavailable.

The pauses between tries are real (a quarter of a second, then doubling); the deadline
is on the app's clock, which the tests' store moves forward at each failed try, so no
assertion depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tokenline import (
    App,
    FakeClock,
    JobState,
    SchemaVersionError,
    StoreCorruptError,
    StoreUnavailableError,
    Worker,
    WorkerSettings,
)
from tokenline._jobs import WorkerRecord
from tokenline.stores import MemoryStore

DEADLINE = 30.0


class Unreachable(MemoryStore):
    """A memory store whose first ``failures`` opens raise ``error``, and then whose
    first ``register_failures`` registrations do, each moving the clock ``step`` seconds
    on (the time a refused connection or a timeout takes)."""

    def __init__(
        self, clock: FakeClock, failures: int, error: Exception | None = None, step: float = 1.0,
        register_failures: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(clock=clock)
        self.fake_clock = clock
        self.failures = failures
        self.register_failures = register_failures
        self.error = error or StoreUnavailableError("connection refused")
        self.step = step
        self.opens = 0
        self.registrations = 0
        self.closes = 0

    async def open(self) -> None:
        self.opens += 1
        if self.opens <= self.failures:
            self.fake_clock.advance(self.step)
            raise self.error
        await super().open()

    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        self.registrations += 1
        if self.registrations <= self.register_failures:
            self.fake_clock.advance(self.step)
            raise StoreUnavailableError("database is locked")
        return await super().worker_register(record=record, ttl=ttl)

    async def close(self) -> None:
        self.closes += 1
        await super().close()


def settings(startup_wait: float) -> WorkerSettings:
    return WorkerSettings(startup_wait=startup_wait, poll_interval=0.02, concurrency=1)


async def run_until_job_done(worker: Worker, store: MemoryStore, job_id: int) -> None:
    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(DEADLINE):
            while (await store.job_get(job_id=job_id)).state is not JobState.SUCCEEDED:
                assert not task.done(), task
                await asyncio.sleep(0.01)
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)


async def test_a_worker_waits_for_a_store_that_comes_up(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    app = App("memory://", clock=clock)
    ran: list[int] = []

    @app.task(name="t")
    async def t(ctx: object, i: int) -> None:
        ran.append(i)

    store = Unreachable(clock, failures=2)
    await store.jobs_enqueue(jobs=[app.build_job("t", (7,), None)])
    worker = Worker(app, settings(60), store=store)
    with caplog.at_level(logging.WARNING, logger="tokenline.worker"):
        await run_until_job_done(worker, store, 1)
    assert store.opens == 3
    assert ran == [7]
    tries = [r.getMessage() for r in caplog.records if "store unavailable" in r.getMessage()]
    assert len(tries) == 2, tries
    assert all("connection refused" in m for m in tries), tries


async def test_without_startup_wait_an_unavailable_store_ends_the_start_at_once() -> None:
    clock = FakeClock()
    store = Unreachable(clock, failures=1)
    worker = Worker(App("memory://", clock=clock), settings(0), store=store)
    with pytest.raises(StoreUnavailableError, match="connection refused"):
        await asyncio.wait_for(worker.run(), DEADLINE)
    assert store.opens == 1
    assert store.closes == 1


async def test_a_registration_the_store_refuses_is_tried_again_within_the_wait() -> None:
    """The store opens but is busy when the worker registers: the start goes on trying
    the registration (not the open again) within ``startup_wait``, then runs jobs."""
    clock = FakeClock()
    app = App("memory://", clock=clock)

    @app.task(name="t")
    async def t(ctx: object, i: int) -> None:
        """Nothing."""

    store = Unreachable(clock, failures=0, register_failures=2)
    await store.jobs_enqueue(jobs=[app.build_job("t", (1,), None)])
    await run_until_job_done(Worker(app, settings(60), store=store), store, 1)
    assert (store.opens, store.registrations) == (1, 3)


async def test_without_startup_wait_a_refused_registration_ends_the_start_and_closes() -> None:
    clock = FakeClock()
    store = Unreachable(clock, failures=0, register_failures=1)
    worker = Worker(App("memory://", clock=clock), settings(0), store=store)
    with pytest.raises(StoreUnavailableError, match="database is locked"):
        await asyncio.wait_for(worker.run(), DEADLINE)
    assert (store.registrations, store.closes) == (1, 1)


async def test_the_wait_gives_up_with_the_last_error_once_its_time_is_spent() -> None:
    clock = FakeClock()
    store = Unreachable(clock, failures=100, step=10.0)
    worker = Worker(App("memory://", clock=clock), settings(25), store=store)
    with pytest.raises(StoreUnavailableError):
        await asyncio.wait_for(worker.run(), DEADLINE)
    # Tried at 0 (10 s spent), 10 (20 s), 20 (30 s: past 25, given up).
    assert store.opens == 3
    assert await store.workers_list() == []


@pytest.mark.parametrize(
    "error",
    [SchemaVersionError("schema version 99"), StoreCorruptError("not a tokenline store")],
    ids=["schema", "corrupt"],
)
async def test_errors_other_than_unavailable_end_the_start_at_once(error: Exception) -> None:
    clock = FakeClock()
    store = Unreachable(clock, failures=1, error=error)
    worker = Worker(App("memory://", clock=clock), settings(600), store=store)
    with pytest.raises(type(error)):
        await asyncio.wait_for(worker.run(), DEADLINE)
    assert store.opens == 1


async def test_a_shutdown_request_ends_the_wait(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store = Unreachable(clock, failures=1_000_000, step=0.0)
    worker = Worker(App("memory://", clock=clock), settings(3600), store=store)
    task = asyncio.create_task(worker.run())
    async with asyncio.timeout(DEADLINE):
        # Polling: the store has no event for a failed open.
        while store.opens < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="tokenline.worker"):
        worker.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)  # returns: no error, no membership
    assert task.exception() is None
    assert await store.workers_list() == []
    assert any("stopped while waiting" in r.getMessage() for r in caplog.records)
    opens = store.opens
    await asyncio.sleep(0.3)
    assert store.opens == opens


async def test_a_shutdown_request_ends_a_try_that_is_still_waiting() -> None:
    """A try under way (an open waiting for a store that does not answer, up to its
    store timeout) was waited out before the stop took effect. It is cancelled: the
    worker stops at once, and the store is closed."""

    class Silent(Unreachable):
        """Its open waits until cancelled, as one on a silent server does."""

        async def open(self) -> None:
            self.opens += 1
            await asyncio.Event().wait()

    clock = FakeClock()
    store = Silent(clock, failures=0)
    worker = Worker(App("memory://", clock=clock), settings(3600), store=store)
    task = asyncio.create_task(worker.run())
    async with asyncio.timeout(DEADLINE):
        while store.opens < 1:  # noqa: ASYNC110 - no event for an open begun
            await asyncio.sleep(0.01)
    worker.request_shutdown()
    # Far below the store timeout it would have waited out (10 s by default); the
    # try has no end of its own here, so waiting it out would never return.
    await asyncio.wait_for(task, DEADLINE)
    assert task.exception() is None
    assert store.closes >= 1


async def test_a_signal_kept_before_the_worker_started_stops_it() -> None:
    """`tokenline worker` keeps SIGTERM and SIGINT in a SignalLatch until the worker
    takes them over. A SIGTERM in that window (a supervisor stopping a worker it just
    started) was ignored, and the worker ran until a second one. The worker acts on it
    as soon as it starts; after it stops, the latch is back and signals do no harm."""
    import signal

    from tokenline.worker.worker import SignalLatch

    latch = SignalLatch()
    before = {sig: signal.signal(sig, latch) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        latch(signal.SIGTERM, None)  # as the handler is called while the process starts
        worker = Worker(App("memory://"), settings(0))
        await asyncio.wait_for(worker.run(install_signal_handlers=True), DEADLINE)
        assert worker.counters.started == 0
        assert signal.getsignal(signal.SIGTERM) is latch
        assert latch.take() == 0
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
