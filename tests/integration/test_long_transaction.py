"""A job inside an open ``ctx.transaction()`` keeps its lease, and holds up no renewal.

One worker, lease TTL 1.5 s: one job keeps its fenced transaction open for three TTLs
(``async with`` in an async handler, or ``with`` in a sync one) while a second job,
outside any transaction, runs for two. Before the leases moved out
of the locked rows (PostgreSQL: the job row's lock; SQLite: the file's write lock),
the worker's batched renewal waited on its own handler's transaction, failed, and both
jobs went dead after their attempts. Here both succeed on their first attempt and the
worker never leaves READY/PROCESSING.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenline import App, JobContext, Worker, WorkerSettings, WorkerState
from tokenline._jobs import JobState

#: Generous: these tests must pass on a slow, noisy machine.
DEADLINE = 60.0

TTL = 1.5
SETTINGS = WorkerSettings(
    lease_ttl=TTL,
    renew_interval=0.3,
    poll_interval=0.05,
    rescue_interval=0.3,
    concurrency=2,
)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store of each backend that has transactions."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'long.db'}"
        return
    import psycopg

    server: str = request.getfixturevalue("postgres_server")
    schema = f"tl_long_{uuid.uuid4().hex[:8]}"
    yield f"{server}?schema={schema}&options=-c%20search_path%3D{schema}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def _insert(conn: Any, job_id: int) -> None:
    """One business row, in the connection's own parameter style."""
    if isinstance(conn, sqlite3.Connection):
        conn.execute("INSERT INTO marks (job) VALUES (?)", (job_id,))
    else:
        await conn.execute("INSERT INTO marks (job) VALUES (%s)", (job_id,))


def _insert_sync(conn: Any, job_id: int) -> None:
    """:func:`_insert` on a sync connection (sqlite3's, or psycopg's)."""
    if isinstance(conn, sqlite3.Connection):
        conn.execute("INSERT INTO marks (job) VALUES (?)", (job_id,))
    else:
        conn.execute("INSERT INTO marks (job) VALUES (%s)", (job_id,))


def long_app(url: str) -> App:
    """Tasks that hold a transaction open (async and sync), and one that just takes its
    time."""
    app = App(url)

    @app.task(name="long_tx", max_attempts=1)
    async def long_tx(ctx: JobContext, seconds: float) -> None:
        async with ctx.transaction() as conn:
            await _insert(conn, ctx.job_id)
            await asyncio.sleep(seconds)

    @app.task(name="long_tx_sync", max_attempts=1)
    def long_tx_sync(ctx: JobContext, seconds: float) -> None:
        with ctx.transaction() as conn:
            _insert_sync(conn, ctx.job_id)
            time.sleep(seconds)

    @app.task(name="slow", max_attempts=1)
    async def slow(ctx: JobContext, seconds: float) -> None:
        await asyncio.sleep(seconds)

    return app


def create_marks(url: str) -> None:
    """The business table, in the store's own database (and schema)."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url[len("sqlite:///") :]) as conn:
            conn.execute("CREATE TABLE marks (job integer)")
        return
    import psycopg

    with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
        schema = url.split("schema=")[1].split("&")[0]
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        conn.execute(f"CREATE TABLE {schema}.marks (job integer)")


@pytest.mark.parametrize("form", ["async", "sync"])
async def test_transaction_open_for_three_ttls_keeps_every_lease(url: str, form: str) -> None:
    """A fenced transaction open for 3 x TTL, in either form, commits; meanwhile another
    job of the same worker renews its lease and completes; both succeed on attempt 1,
    nothing is fenced, refused or retried, and the worker never leaves
    READY/PROCESSING."""
    create_marks(url)
    app = long_app(url)
    # The worker's store is opened before anything else: two stores creating a new
    # SQLite file at once can find it locked, and the test polls it from the start.
    store = app.open_store(timeout=SETTINGS.call_timeout)
    await store.open()
    worker = Worker(app, SETTINGS, store=store)
    states: list[WorkerState] = []
    worker.on_state_change = lambda old, new, reason: states.append(new)
    run = asyncio.create_task(worker.run())
    try:
        long_id = await app.enqueue_async("long_tx" if form == "async" else "long_tx_sync", 3 * TTL)
        slow_id = await app.enqueue_async("slow", 2 * TTL)

        async def both_done() -> None:
            while True:
                jobs = [await worker.store.job_get(job_id=j) for j in (long_id, slow_id)]
                if all(j.state.finished for j in jobs):
                    return
                await asyncio.sleep(0.05)

        await asyncio.wait_for(both_done(), DEADLINE)
        store = worker.store
        for job_id in (long_id, slow_id):
            job = await store.job_get(job_id=job_id)
            assert (job.state, job.attempt) == (JobState.SUCCEEDED, 1), job
            attempts = await store.job_attempts(job_id=job_id)
            assert [a.outcome for a in attempts] == ["succeeded"]
        assert (await store.stale_commits())[0] == 0
        counters = worker.counters
        assert (counters.fenced, counters.coordination_errors, counters.stale_refused) == (0, 0, 0)
        assert set(states) <= {WorkerState.READY, WorkerState.PROCESSING}, states
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(run, DEADLINE)
        app.close()


async def test_a_transaction_cancelled_while_it_waits_for_the_lock_leaves_none(
    tmp_path: Path,
) -> None:
    """A handler cancelled (a hard timeout, a fenced worker) while its fenced transaction
    waits for SQLite's write lock: the waiting thread still takes the lock once it is
    free, and must give it straight back, or every process's writes wait for it (this
    process's own calls for ever: they wait for their own transactions)."""
    import threading

    from tokenline._jobs import NewJob
    from tokenline.stores.sqlite import SQLiteStore

    store = SQLiteStore(f"sqlite:///{tmp_path / 'cancel.db'}", timeout=5.0)
    await store.open()
    try:
        await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
        (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=60)
        blocker = sqlite3.connect(store.path, timeout=5.0)
        blocker.execute("BEGIN IMMEDIATE")
        # Kept, as the job's context keeps its transaction: no garbage collector closes
        # the connection behind our back.
        transaction = store.fenced_transaction(lease=claimed.lease)
        entered = threading.Event()
        real_enter = transaction.__enter__

        def enter() -> Any:
            try:
                return real_enter()
            finally:
                entered.set()

        transaction.__enter__ = enter  # type: ignore[method-assign]

        async def handler() -> None:
            async with transaction as conn:
                conn.execute("SELECT 1")

        task = asyncio.create_task(handler())
        await asyncio.sleep(0.2)  # its thread waits in BEGIN IMMEDIATE (or soon will)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        blocker.rollback()  # the waiting thread now takes the lock
        blocker.close()
        assert await asyncio.to_thread(entered.wait, 30)
        await asyncio.sleep(0.1)  # the loop runs what the thread's end scheduled
        # The store's own write, and anyone else's, go through: nobody holds the lock.
        await asyncio.wait_for(
            store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")]), 20
        )
        probe = sqlite3.connect(store.path, timeout=10.0)
        probe.execute("BEGIN IMMEDIATE")
        probe.rollback()
        probe.close()
        assert (await store.job_get(job_id=claimed.job.id)).state is JobState.RUNNING
        assert not transaction.committed
    finally:
        await store.close()


async def test_a_memory_transaction_cancelled_while_it_waits_gives_the_lock_back() -> None:
    """The in-memory store's transactions share one lock: one cancelled while waiting
    for it takes it once free, and must give it straight back."""
    import threading

    from tokenline._jobs import NewJob
    from tokenline.stores import MemoryStore

    store = MemoryStore()
    await store.open()
    await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")] * 3)
    first, second, third = await store.jobs_claim(owner="w", queues=["default"], limit=3, ttl=60)
    holder = store.fenced_transaction(lease=first.lease)
    holder.__enter__()
    waiting = store.fenced_transaction(lease=second.lease)
    entered = threading.Event()
    real_enter = waiting.__enter__

    def enter() -> Any:
        try:
            return real_enter()
        finally:
            entered.set()

    waiting.__enter__ = enter  # type: ignore[method-assign]

    async def handler() -> None:
        async with waiting:
            pass

    task = asyncio.create_task(handler())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    holder.__exit__(None, None, None)
    assert await asyncio.to_thread(entered.wait, 30)
    await asyncio.sleep(0.1)  # the loop runs what the thread's end scheduled
    later = store.fenced_transaction(lease=third.lease)
    async with asyncio.timeout(20):
        async with later:
            pass
    assert later.committed
    assert not waiting.committed
