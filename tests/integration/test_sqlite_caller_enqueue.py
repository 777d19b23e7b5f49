"""A blocking enqueue on SQLite writes on the caller's own thread, with a connection
of its own (see ``_callers.py``): never queued behind the store's thread, ordered with
every other writer by the file's lock, and tidy when it fails or the store closes."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from tokenline import (
    App,
    JobContext,
    NotSupportedError,
    Settings,
    StoreUnavailableError,
    Worker,
    WorkerSettings,
)
from tokenline._errors import StoreError
from tokenline._jobs import Job, JobState, NewJob
from tokenline.stores.sqlite import SQLiteStore


def job(n: int = 0) -> NewJob:
    return NewJob(queue="default", task="t", args=f"[{n}]")


async def test_an_enqueue_does_not_wait_for_the_stores_thread(tmp_path: Path) -> None:
    """With the store's thread busy for seconds (a long call of this process), a
    blocking enqueue is written, and counted, at once; through that thread it would
    have waited its turn."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}")
    await store.open()
    release = threading.Event()
    occupied = threading.Event()

    def occupy(conn: sqlite3.Connection) -> None:
        occupied.set()
        release.wait(30)

    busy = asyncio.ensure_future(store._call(occupy))
    try:
        await asyncio.to_thread(occupied.wait, 10)
        caller = threading.current_thread().ident

        def enqueue() -> tuple[list[int], int | None]:
            return store.jobs_enqueue_blocking(jobs=[job()]), threading.current_thread().ident

        (ids, ran_on) = await asyncio.wait_for(asyncio.to_thread(enqueue), 5)
        assert ran_on != caller  # the worker thread asyncio.to_thread chose, not the lane
        assert not busy.done()  # the store's thread is still occupied
        with sqlite3.connect(tmp_path / "q.db") as reader:
            (state,) = reader.execute(
                "SELECT state FROM tokenline_jobs WHERE id = ?", (ids[0],)
            ).fetchone()
        assert state == "queued"
    finally:
        release.set()
        await busy
        await store.close()


async def test_sequential_enqueues_reuse_one_connection(tmp_path: Path) -> None:
    """One caller after another: one connection, kept between calls, sending its write
    transaction and nothing else (no busy-timeout PRAGMA around each one)."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}")
    await store.open()
    try:
        callers = store._callers
        assert callers is not None
        opened: list[sqlite3.Connection] = []
        connect = callers._connect

        sent: list[str] = []

        def counting() -> sqlite3.Connection:
            opened.append(connect())
            opened[-1].set_trace_callback(sent.append)
            return opened[-1]

        callers._connect = counting

        def many() -> list[int]:
            return [store.jobs_enqueue_blocking(jobs=[job(n)])[0] for n in range(50)]

        ids = await asyncio.to_thread(many)
        assert len(set(ids)) == 50
        assert len(opened) == 1
        assert callers.idle == 1
        # A statement that fires a trigger (schema v7's type check) is traced again, with
        # its own text, when the trigger's program starts: counted once.
        statements = [s for n, s in enumerate(sent) if n == 0 or s != sent[n - 1]]
        firsts = [s.split()[0].upper() for s in statements]
        assert firsts == ["BEGIN", "INSERT", "COMMIT"] * 50, sent[:6]
    finally:
        await store.close()


async def test_threads_enqueueing_at_once_all_commit_with_distinct_ids(tmp_path: Path) -> None:
    """Eight threads, 100 enqueues each, at once: 800 jobs, 800 ids, no busy error, and
    no more than ``keep`` connections left open afterwards."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}")
    await store.open()
    try:
        start = threading.Barrier(8)
        results: dict[int, list[int]] = {}

        def worker(w: int) -> None:
            start.wait(10)
            results[w] = [
                store.jobs_enqueue_blocking(jobs=[job(w * 1000 + n)])[0] for n in range(100)
            ]

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            await asyncio.to_thread(t.join, 60)
        ids = [i for r in results.values() for i in r]
        assert len(set(ids)) == 800
        jobs = await store.jobs_list(state=JobState.QUEUED, limit=1000)
        assert sorted(j.id for j in jobs) == sorted(ids)
        assert sorted(j.args for j in jobs) == sorted(
            f"[{w * 1000 + n}]" for w in range(8) for n in range(100)
        )
        assert store._callers is not None
        assert 1 <= store._callers.idle <= 4
    finally:
        await store.close()


async def test_a_lock_held_past_the_timeout_is_a_clear_error_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """Another process holds the write lock: the enqueue waits the store timeout, then
    raises StoreUnavailableError with nothing written, and its connection is closed
    rather than lent again. Once the lock is free, enqueues work as before."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}", timeout=0.3)
    await store.open()
    holder = sqlite3.connect(tmp_path / "q.db", isolation_level=None, check_same_thread=False)
    try:
        await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[job()])
        assert store._callers is not None
        assert store._callers.idle == 1
        holder.execute("BEGIN IMMEDIATE")
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[job(1)])
        assert time.monotonic() - began >= 0.3
        assert store._callers.idle == 0
        holder.execute("ROLLBACK")
        await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[job(2)])
        args = sorted(j.args for j in await store.jobs_list(state=JobState.QUEUED))
        assert args == ["[0]", "[2]"]
    finally:
        holder.close()
        await store.close()


async def test_the_lock_freed_while_waiting_is_taken(tmp_path: Path) -> None:
    """A lock another process holds for a while (under the store timeout) is waited
    for, and the enqueue then lands."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}", timeout=10)
    await store.open()
    holder = sqlite3.connect(tmp_path / "q.db", isolation_level=None, check_same_thread=False)
    timer = threading.Timer(0.5, holder.rollback)
    try:
        holder.execute("BEGIN IMMEDIATE")
        timer.start()
        began = time.monotonic()
        (jid,) = await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[job()])
        assert time.monotonic() - began >= 0.4
        assert (await store.job_get(job_id=jid)).state is JobState.QUEUED
    finally:
        # Never closed under the timer's rollback, which may still be running.
        if timer.is_alive():
            await asyncio.to_thread(timer.join)
        holder.close()
        await store.close()


async def test_closing_waits_for_an_enqueue_in_progress_then_refuses_more(
    tmp_path: Path,
) -> None:
    """``close()`` while an enqueue waits for a lock: the enqueue finishes (the row is
    in the file), its connection is closed, not kept; a later enqueue is refused with a
    clear error, and so is one on a store never opened."""
    path = tmp_path / "q.db"
    store = SQLiteStore(f"sqlite:///{path}", timeout=10)
    await store.open()
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    enqueue = asyncio.ensure_future(asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[job()]))
    await asyncio.sleep(0.3)  # the enqueue is waiting for the lock
    callers = store._callers
    assert callers is not None
    rollback = threading.Timer(0.5, holder.rollback)
    rollback.start()
    await store.close()
    with sqlite3.connect(path) as reader:  # close waited for the enqueue to commit
        assert reader.execute("SELECT id FROM tokenline_jobs").fetchall() == [(1,)]
    assert await enqueue == [1]
    assert callers.idle == 0
    # Not closed under the timer's rollback, which may still be running.
    await asyncio.to_thread(rollback.join)
    holder.close()
    with pytest.raises(StoreError, match="not open"):
        store.jobs_enqueue_blocking(jobs=[job()])
    with pytest.raises(StoreError, match="not open"):
        SQLiteStore(f"sqlite:///{tmp_path / 'other.db'}").jobs_enqueue_blocking(jobs=[job()])


async def test_an_enqueue_inside_the_threads_own_transaction_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """A blocking enqueue from the thread that holds the file's write lock in a sync
    fenced transaction would wait for itself (here: until the store timeout, then a
    busy error; in the worker's own store, for ever). It is refused at once, by any
    store on that file, naming ``connection=``. Another thread's enqueue meanwhile
    waits for the lock and lands after the commit, and so does this thread's once the
    transaction is over."""
    path = tmp_path / "q.db"
    worker_store = SQLiteStore(f"sqlite:///{path}", timeout=30)
    app_store = SQLiteStore(f"sqlite:///{tmp_path}/../{tmp_path.name}/q.db", timeout=30)
    await worker_store.open()
    await app_store.open()
    try:
        await worker_store.jobs_enqueue(jobs=[job()])
        (claimed,) = await worker_store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=60)

        def in_transaction() -> tuple[float, str, list[int]]:
            with worker_store.fenced_transaction(lease=claimed.lease, timeout=30) as conn:
                began = time.monotonic()
                with pytest.raises(NotSupportedError) as refused:
                    app_store.jobs_enqueue_blocking(jobs=[job(1)])
                took = time.monotonic() - began
                other: list[int] = []
                elsewhere = threading.Thread(
                    target=lambda: other.extend(app_store.jobs_enqueue_blocking(jobs=[job(2)]))
                )
                elsewhere.start()
                time.sleep(0.2)
                assert other == []  # waiting for this transaction's lock
                conn.execute("CREATE TABLE marks (n)")
            elsewhere.join(30)
            return took, str(refused.value), other

        took, message, other = await asyncio.to_thread(in_transaction)
        assert took < 5  # not the store timeout (30 s)
        assert "connection=conn" in message
        assert len(other) == 1
        await asyncio.to_thread(app_store.jobs_enqueue_blocking, jobs=[job(3)])
        args = sorted(j.args for j in await app_store.jobs_list(state=JobState.QUEUED))
        assert args == ["[2]", "[3]"]
        assert (await worker_store.job_get(job_id=claimed.job.id)).state is JobState.SUCCEEDED
    finally:
        await app_store.close()
        await worker_store.close()


async def test_an_async_transaction_marks_no_thread(tmp_path: Path) -> None:
    """``async with`` enters and leaves on pool threads, which run other calls
    meanwhile: blocking enqueues from those threads are not refused; they wait for the
    lock and land after the commit."""
    path = tmp_path / "q.db"
    store = SQLiteStore(f"sqlite:///{path}", timeout=30)
    await store.open()
    try:
        await store.jobs_enqueue(jobs=[job()])
        (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=60)
        results: list[int] = []

        def enqueue(n: int) -> None:
            results.extend(store.jobs_enqueue_blocking(jobs=[job(n)]))

        async with store.fenced_transaction(lease=claimed.lease, timeout=30) as conn:
            # Some of these run on the pool thread that entered the transaction.
            waiting = [asyncio.ensure_future(asyncio.to_thread(enqueue, n)) for n in range(1, 4)]
            await asyncio.sleep(0.3)
            assert not any(w.done() for w in waiting)
            assert results == []
            conn.execute("CREATE TABLE marks (n)")
        await asyncio.gather(*waiting)
        assert len(set(results)) == 3
    finally:
        await store.close()


async def _outer_job_run(app: App, store: SQLiteStore) -> tuple[Job, list[Job]]:
    """Run one ``outer`` job (argument 10) on a worker of ``store`` until it finishes;
    that job, and the jobs then queued (read before the worker closes the store)."""
    settings = WorkerSettings(lease_ttl=60, poll_interval=0.05, queues=("outer",))
    worker = Worker(app, settings, store=store)
    run = asyncio.create_task(worker.run())
    try:
        # Through the worker's store: the app's own is not open yet, as in a worker
        # process whose handler enqueues first.
        (jid,) = await store.jobs_enqueue(jobs=[app.build_job("outer", (10,))])

        async def finished() -> Job:
            while True:
                got = await store.job_get(job_id=jid)
                if got.state.finished:
                    return got
                await asyncio.sleep(0.05)

        done = await asyncio.wait_for(finished(), 60)
        return done, await store.jobs_list(state=JobState.QUEUED)
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(run, 60)


async def test_a_sync_handler_enqueueing_inside_its_transaction_is_told_how(
    tmp_path: Path,
) -> None:
    """In a worker, a sync handler calling ``app.enqueue`` inside its own
    ``ctx.transaction()`` gets NotSupportedError at once (the app's first enqueue in
    the process, too), not a wait for its own lock; ``connection=conn`` enqueues in the
    transaction, and the handler's job succeeds."""
    # Waiting for its own lock, the enqueue would give up after the store timeout.
    app = App(f"sqlite:///{tmp_path / 'q.db'}", settings=Settings(store_timeout=30))
    refusals: list[tuple[str, float]] = []
    runs: list[int] = []

    @app.task(name="inner")
    def inner(ctx: JobContext, n: int) -> None:
        """Never runs here (no worker reads its queue)."""

    @app.task(name="outer", queue="outer", max_attempts=1)
    def outer(ctx: JobContext, n: int) -> None:
        runs.append(ctx.attempt)
        with ctx.transaction() as conn:
            began = time.monotonic()
            try:
                app.enqueue("inner", n)
            except NotSupportedError as exc:
                refusals.append((str(exc), time.monotonic() - began))
            app.enqueue("inner", n + 1, connection=conn)

    store = app.open_store(timeout=5)
    await store.open()
    try:
        done, queued = await _outer_job_run(app, store)
        assert done.state is JobState.SUCCEEDED, done
        assert runs == [1]  # no attempt given back after a wait for its own lock
        ((message, took),) = refusals
        assert "connection=conn" in message
        assert took < 15  # refused, not waited out
        assert [(j.task, j.args) for j in queued] == [("inner", '{"args":[11],"kwargs":{}}')]
    finally:
        await asyncio.to_thread(app.close)
        await store.close()


@pytest.mark.parametrize("through", ["app", "store"])
async def test_an_async_handler_enqueueing_inside_its_transaction_is_told_how(
    tmp_path: Path, through: str
) -> None:
    """An async handler awaiting an enqueue without ``connection=conn`` inside its own
    ``async with ctx.transaction()`` waited for its own write lock until the store
    timeout, then was given back (a coordination error) and ran again, for ever,
    holding the lock 10 s each time. It is refused at once; ``connection=conn``
    enqueues in the transaction, and tasks the handler starts are not refused."""
    app = App(f"sqlite:///{tmp_path / 'q.db'}", settings=Settings(store_timeout=30))
    refusals: list[tuple[str, float]] = []
    runs: list[int] = []
    store = app.open_store(timeout=5)

    @app.task(name="inner")
    def inner(ctx: JobContext, n: int) -> None:
        """Never runs here (no worker reads its queue)."""

    @app.task(name="outer", queue="outer", max_attempts=1)
    async def outer(ctx: JobContext, n: int) -> None:
        runs.append(ctx.attempt)
        async with ctx.transaction() as conn:
            began = time.monotonic()
            try:
                if through == "app":
                    await app.enqueue_async("inner", n)
                else:
                    await app.enqueue_async("inner", n, store=store)
            except NotSupportedError as exc:
                refusals.append((str(exc), time.monotonic() - began))
            await app.enqueue_async("inner", n + 1, connection=conn)
            # A task of its own waits for the commit, and then enqueues.
            later = asyncio.ensure_future(app.enqueue_async("inner", n + 2, store=store))
        await later

    await store.open()
    try:
        done, queued = await _outer_job_run(app, store)
        assert done.state is JobState.SUCCEEDED, done
        assert runs == [1]
        ((message, took),) = refusals
        assert "connection=conn" in message
        assert took < 15  # refused, not waited out
        assert sorted(j.args for j in queued) == [
            '{"args":[11],"kwargs":{}}',
            '{"args":[12],"kwargs":{}}',
        ]
    finally:
        await asyncio.to_thread(app.close)
        await store.close()


@pytest.mark.parametrize("form", ["sync", "async"])
async def test_a_cancel_inside_the_handlers_own_transaction_is_refused_at_once(
    tmp_path: Path, form: str
) -> None:
    """``app.cancel`` inside the handler's own ``ctx.transaction()`` waited for the
    transaction's write lock until the store timeout, and the job was given back and
    run again for ever. It is refused at once, naming the way out."""
    app = App(f"sqlite:///{tmp_path / 'q.db'}", settings=Settings(store_timeout=30))
    refusals: list[tuple[str, float]] = []

    def outer(ctx: JobContext, n: int) -> None:
        with ctx.transaction():
            began = time.monotonic()
            try:
                app.cancel(99_999)
            except NotSupportedError as exc:
                refusals.append((str(exc), time.monotonic() - began))

    async def outer_async(ctx: JobContext, n: int) -> None:
        async with ctx.transaction():
            began = time.monotonic()
            try:
                await app.cancel_async(99_999)
            except NotSupportedError as exc:
                refusals.append((str(exc), time.monotonic() - began))

    app.task(name="outer", queue="outer", max_attempts=1)(outer if form == "sync" else outer_async)

    store = app.open_store(timeout=5)
    await store.open()
    try:
        done, _ = await _outer_job_run(app, store)
        assert done.state is JobState.SUCCEEDED, done
        ((message, took),) = refusals
        assert "cancel inside an open ctx.transaction()" in message
        assert "cancel before or after it" in message
        assert took < 15  # refused, not waited out
    finally:
        await asyncio.to_thread(app.close)
        await store.close()


def test_an_outbox_enqueue_on_a_new_file_says_to_migrate(tmp_path: Path) -> None:
    """An enqueue on the caller's connection runs in the caller's transaction and never
    creates the schema: on a file without it the error says so and how to migrate,
    the caller's transaction goes on, and after a migration the same call works."""
    from tokenline import StoreCorruptError

    path = tmp_path / "new.db"
    app = App(f"sqlite:///{path}")
    app.task(name="t")(lambda ctx: None)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE orders (id INTEGER)")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO orders VALUES (1)")
        with pytest.raises(StoreCorruptError) as info:
            app.enqueue("t", connection=conn)
        for part in (str(path), "never creates it", "tokenline migrate"):
            assert part in str(info.value), info.value
        assert conn.in_transaction
        conn.execute("ROLLBACK")
        app.run(lambda s: s.queues_stats())  # the app's own store migrates
        conn.execute("BEGIN")
        jid = app.enqueue("t", connection=conn)
        conn.execute("COMMIT")
        assert app.run(lambda s: s.job_get(job_id=jid)).state is JobState.QUEUED
    finally:
        conn.close()
        app.close()
