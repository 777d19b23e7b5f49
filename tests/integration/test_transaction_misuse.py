"""A handler that ends its own ``ctx.transaction()``: refused, nothing written, the job
dead with the reason.

Committing inside the block made the user's writes durable without the job's
completion: when the handler then failed, the retry wrote them again (two rows for one
job). Rolling back inside it let the block's later statements commit one by one, with
the same result. The block may not end the transaction: leaving it commits everything
together with the completion, an exception in it rolls everything back.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenline import App, JobContext, NotSupportedError, Worker, WorkerSettings
from tokenline._jobs import JobState

#: Generous: these tests must pass on a slow, noisy machine.
DEADLINE = 60.0

SETTINGS = WorkerSettings(
    lease_ttl=5.0,
    renew_interval=0.5,
    poll_interval=0.05,
    rescue_interval=0.5,
    concurrency=1,
)

#: How the handler ends the transaction itself, in its block.
MODES = ["commit", "sql_commit", "rollback_then_write", "commit_swallowed"]


@pytest.fixture(params=["sqlite", "postgres", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store of each backend that has transactions, with the business table
    (the in-memory store's is made once it is open)."""
    if request.param == "memory":
        yield "memory://"
        return
    if request.param == "sqlite":
        path = tmp_path / "misuse.db"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE marks (job integer, token integer)")
        yield f"sqlite:///{path}"
        return
    import psycopg

    server: str = request.getfixturevalue("postgres_server")
    schema = f"tl_misuse_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.marks (job integer, token integer)")
    yield f"{server}?schema={schema}&options=-c%20search_path%3D{schema}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def _end(conn: Any, mode: str) -> None:
    """End the transaction the way ``mode`` says (sqlite3's or psycopg's sync API)."""
    if mode == "commit":
        conn.commit()
    elif mode == "sql_commit":
        conn.execute("COMMIT")
    elif mode == "rollback_then_write":
        conn.execute("ROLLBACK")
    elif mode == "commit_swallowed":
        with contextlib.suppress(Exception):  # the misuse under test: carrying on
            conn.execute("COMMIT")


def misuse_app(url: str) -> App:
    """The same misuse in a sync and an async handler; each fails its first attempt
    after ending the transaction, so a write that got out would be written again."""
    app = App(url)
    p = "%s" if url.startswith("postgresql") else "?"
    insert = f"INSERT INTO marks (job, token) VALUES ({p}, {p})"

    @app.task(name="sync_misuse", max_attempts=3)
    def sync_misuse(ctx: JobContext, mode: str) -> None:
        with ctx.transaction() as conn:
            conn.execute(insert, (ctx.job_id, ctx.token))
            _end(conn, mode)
            if mode == "rollback_then_write":
                conn.execute(insert, (ctx.job_id, ctx.token))
            if ctx.attempt == 1:
                raise RuntimeError("failed after ending the transaction")

    @app.task(name="async_misuse", max_attempts=3)
    async def async_misuse(ctx: JobContext, mode: str) -> None:
        async with ctx.transaction() as conn:
            if isinstance(conn, sqlite3.Connection):
                conn.execute(insert, (ctx.job_id, ctx.token))
                _end(conn, mode)
                if mode == "rollback_then_write":
                    conn.execute(insert, (ctx.job_id, ctx.token))
            else:
                await conn.execute(insert, (ctx.job_id, ctx.token))
                if mode == "commit":
                    await conn.commit()
                elif mode == "commit_swallowed":
                    with contextlib.suppress(Exception):  # the misuse under test
                        await conn.execute("COMMIT")
                else:
                    await conn.execute("COMMIT" if mode == "sql_commit" else "ROLLBACK")
                if mode == "rollback_then_write":
                    await conn.execute(insert, (ctx.job_id, ctx.token))
            if ctx.attempt == 1:
                raise RuntimeError("failed after ending the transaction")

    return app


def _marks(url: str, store: Any) -> list[tuple[int, int]]:
    if url == "memory://":
        return [tuple(r) for r in store.database.connection.execute("SELECT job, token FROM marks")]
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url[len("sqlite:///") :]) as conn:
            return [tuple(r) for r in conn.execute("SELECT job, token FROM marks")]
    import psycopg

    schema = url.split("schema=")[1].split("&")[0]
    with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
        return [tuple(r) for r in conn.execute(f"SELECT job, token FROM {schema}.marks")]


@contextlib.asynccontextmanager
async def _working(app: App) -> AsyncIterator[Any]:
    """The app's store, open, with a worker running on it until the block ends; the app
    is closed afterwards. The in-memory store gets its business table here."""
    store = app.open_store(timeout=SETTINGS.call_timeout)
    await store.open()
    if app.url == "memory://":
        store.database.connection.execute("CREATE TABLE marks (job integer, token integer)")
    worker = Worker(app, SETTINGS, store=store)
    run = asyncio.create_task(worker.run())
    try:
        yield store
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(run, DEADLINE)
        app.close()


async def _finished(store: Any, job_ids: list[int]) -> list[Any]:
    """The jobs ``job_ids`` once every one of them is finished (within DEADLINE)."""

    async def poll() -> list[Any]:
        while True:
            jobs = [await store.job_get(job_id=j) for j in job_ids]
            if all(j.state.finished for j in jobs):
                return jobs
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), DEADLINE)


@pytest.mark.parametrize("form", ["sync", "async"])
async def test_a_handler_that_ends_its_transaction_writes_nothing_and_goes_dead(
    url: str, form: str
) -> None:
    """Every way of ending the transaction inside the block, in both forms: no business
    row at all (the refused attempt's writes are rolled back, and it is not retried),
    and each job dead on its first attempt, its error saying that ending the
    transaction inside ``ctx.transaction()`` is refused."""
    app = misuse_app(url)
    async with _working(app) as store:
        ids = [await app.enqueue_async(f"{form}_misuse", mode) for mode in MODES]
        for job, mode in zip(await _finished(store, ids), MODES, strict=True):
            assert (job.state, job.attempt, job.error_class) == (
                JobState.DEAD,
                1,
                "permanent",
            ), (mode, job)
            assert job.last_error is not None
            assert "inside `with ctx.transaction()` is refused" in job.last_error, (mode, job)
        assert _marks(url, store) == []


@pytest.mark.parametrize("statement", ["update", "delete", "replace"])
async def test_a_block_that_changes_its_own_job_row_on_sqlite_goes_dead(
    tmp_path: Path, statement: str
) -> None:
    """The job rows share the SQLite file with the user's tables. A block that changed
    its own job row (marked it succeeded) made the completion fail: the job went back
    to its queue without spending an attempt and the same block ran again, for ever.
    Refused like an end of the transaction: nothing written, the job dead at once."""
    path = tmp_path / "own.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE marks (job integer, token integer)")
    app = App(f"sqlite:///{path}")
    sql = {
        "update": "UPDATE tokenline_jobs SET state = 'succeeded' WHERE id = ?",
        "delete": "DELETE FROM tokenline_attempts WHERE job_id = ?",
        # REPLACE deletes the row it conflicts with without asking about a DELETE.
        "replace": "INSERT OR REPLACE INTO tokenline_jobs SELECT * FROM tokenline_jobs "
        "WHERE id = ?",
    }[statement]

    @app.task(name="meddle", max_attempts=3)
    def meddle(ctx: JobContext) -> None:
        with ctx.transaction() as conn:
            conn.execute("INSERT INTO marks (job, token) VALUES (?, ?)", (ctx.job_id, ctx.token))
            conn.execute(sql, (ctx.job_id,))

    async with _working(app) as store:
        (job,) = await _finished(store, [await app.enqueue_async("meddle")])
        assert (job.state, job.attempt, job.error_class) == (JobState.DEAD, 1, "permanent")
        assert job.last_error is not None
        table = "tokenline_attempts" if statement == "delete" else "tokenline_jobs"
        assert f"of {table}" in job.last_error
        assert _marks(f"sqlite:///{path}", store) == []


async def test_a_block_may_enqueue_through_its_own_connection_on_sqlite(tmp_path: Path) -> None:
    """The guard refuses the block's own writes to the job rows, not the store's: a job
    enqueued with connection=conn inside the block exists once the block commits, and
    not at all when it rolls back."""
    path = tmp_path / "chain.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE marks (job integer, token integer)")
    app = App(f"sqlite:///{path}")

    @app.task(name="next")
    def follow(ctx: JobContext, parent: int) -> None:
        """The job a first one enqueues."""

    @app.task(name="first", max_attempts=2)
    def first(ctx: JobContext) -> None:
        with ctx.transaction() as conn:
            conn.execute("INSERT INTO marks (job, token) VALUES (?, ?)", (ctx.job_id, ctx.token))
            app.enqueue("next", ctx.job_id, connection=conn)
            if ctx.attempt == 1:
                raise RuntimeError("rolled back with its enqueue")

    async with _working(app) as store:
        jid = await app.enqueue_async("first")
        (parent,) = await _finished(store, [jid])
        assert (parent.state, parent.attempt) == (JobState.SUCCEEDED, 2)
        (child,) = [j for j in await store.jobs_list() if j.task == "next"]
        (child,) = await _finished(store, [child.id])
        assert child.args == f'{{"args":[{jid}],"kwargs":{{}}}}'
        assert len(_marks(f"sqlite:///{path}", store)) == 1


@pytest.mark.parametrize(
    "statement",
    [
        "SET CONSTRAINTS ALL IMMEDIATE",  # runs the guard's deferred check now
        "DO $$ BEGIN COMMIT; END $$",  # the server refuses it inside a transaction
    ],
)
async def test_other_ways_to_end_a_postgres_block_are_permanent_errors(
    postgres_server: str, statement: str
) -> None:
    """Whatever refuses it (the guard, or the server itself), a block that tries to end
    its transaction fails its job for good with the reason, not as a transient error
    retried until its attempts run out; nothing it wrote is kept."""
    import psycopg

    schema = f"tl_misuse_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.marks (job integer, token integer)")
    url = f"{postgres_server}?schema={schema}&options=-c%20search_path%3D{schema}"
    app = App(url)

    @app.task(name="ender", max_attempts=3)
    def ender(ctx: JobContext) -> None:
        with ctx.transaction() as conn:
            conn.execute("INSERT INTO marks (job, token) VALUES (%s, %s)", (ctx.job_id, ctx.token))
            conn.execute(statement)

    try:
        async with _working(app) as store:
            (job,) = await _finished(store, [await app.enqueue_async("ender")])
            assert (job.state, job.attempt, job.error_class) == (JobState.DEAD, 1, "permanent")
            assert "inside `with ctx.transaction()` is refused" in (job.last_error or "")
            assert _marks(url, store) == []
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.parametrize(
    "statement",
    [
        "DELETE FROM tokenline_effects",
        "UPDATE tokenline_fences SET token = 0",
        "DELETE FROM tokenline_unique_keys",
        "DROP TRIGGER tokenline_jobs_monotonic",
        "CREATE TRIGGER wipe AFTER INSERT ON marks BEGIN DELETE FROM tokenline_effects; END",
        "DELETE FROM coord.job_leases",
        "DETACH DATABASE coord",
        "PRAGMA journal_mode = DELETE",
        "close",
    ],
)
async def test_a_sqlite_block_may_not_touch_the_stores_rows_schema_or_settings(
    tmp_path: Path, statement: str
) -> None:
    """The block's connection is the store's file: a handler that deleted the ledger's
    effect records (so that an effect ran twice), dropped the store's triggers or set a
    pragma got its way. Each is refused, the job dead at once with the reason, nothing
    of the block written, and the store's ledger, schema and settings as they were."""
    path = tmp_path / "guard.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE marks (job integer, token integer)")
    url = f"sqlite:///{path}"
    app = App(url)
    ran: list[int] = []

    @app.task(name="charge")
    def charge(ctx: JobContext) -> None:
        ctx.effect("charge:1", ran.append, 1)

    @app.task(name="meddle", max_attempts=3)
    def meddle(ctx: JobContext) -> None:
        with ctx.transaction() as conn:
            conn.execute("INSERT INTO marks (job, token) VALUES (?, ?)", (ctx.job_id, ctx.token))
            with contextlib.suppress(sqlite3.DatabaseError, NotSupportedError):  # carrying on
                if statement == "close":
                    conn.close()
                else:
                    conn.execute(statement)

    async with _working(app) as store:
        (done,) = await _finished(store, [await app.enqueue_async("charge")])
        assert done.state is JobState.SUCCEEDED
        (job,) = await _finished(store, [await app.enqueue_async("meddle")])
        assert (job.state, job.attempt, job.error_class) == (JobState.DEAD, 1, "permanent")
        assert "inside `with ctx.transaction()` is refused" in (job.last_error or ""), job
        assert _marks(url, store) == []
        (again,) = await _finished(store, [await app.enqueue_async("charge")])
        assert again.state is JobState.SUCCEEDED
    assert ran == [1], "the effect ran again"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    assert "tokenline_jobs_monotonic" in names
    assert "wipe" not in names
    assert mode == "wal"


def keeper_app(url: str) -> tuple[App, dict[str, list[str]]]:
    """Handlers that keep the block's connection and a cursor, and write through both
    after the block ended: each write's fate is reported by its job id."""
    app = App(url)
    postgres = url.startswith("postgresql")
    p = "%s" if postgres else "?"
    insert = f"INSERT INTO marks (job, token) VALUES ({p}, {p})"
    fates: dict[str, list[str]] = {}

    def fate(write: Any) -> str:
        try:
            write()
        except Exception as exc:  # the kept reference must not write: say how it failed
            return type(exc).__name__
        return "written"

    @app.task(name="sync_keeper")
    def sync_keeper(ctx: JobContext, unset: bool) -> None:
        with ctx.transaction() as conn:
            cur = conn.cursor()
            conn.execute(insert, (ctx.job_id, 1))
            if unset:  # the block turns the pool's setting off for the connection
                conn.execute("SET default_transaction_read_only = off")

        def in_a_transaction() -> None:
            with conn.transaction():
                conn.execute(insert, (ctx.job_id, 4))

        fates[f"sync{ctx.job_id}"] = [
            fate(lambda: conn.execute(insert, (ctx.job_id, 2))),
            fate(lambda: cur.execute(insert, (ctx.job_id, 3))),
            fate(in_a_transaction if postgres else lambda: conn.commit()),
        ]

    @app.task(name="async_keeper")
    async def async_keeper(ctx: JobContext, unset: bool) -> None:
        async with ctx.transaction() as conn:
            if isinstance(conn, sqlite3.Connection):
                conn.execute(insert, (ctx.job_id, 1))
            else:
                await conn.execute(insert, (ctx.job_id, 1))
                if unset:
                    await conn.execute("SET default_transaction_read_only = off")
        if isinstance(conn, sqlite3.Connection):
            fates[f"async{ctx.job_id}"] = [fate(lambda: conn.execute(insert, (ctx.job_id, 2)))]
            return
        outcome = []
        for token in (2, 3):
            try:
                if token == 2:
                    await conn.execute(insert, (ctx.job_id, token))
                else:
                    async with conn.transaction():
                        await conn.execute(insert, (ctx.job_id, token))
                outcome.append("written")
            except Exception as exc:  # as fate() above
                outcome.append(type(exc).__name__)
        fates[f"async{ctx.job_id}"] = outcome

    return app, fates


@pytest.mark.parametrize(
    ("url", "unset"),
    [("sqlite", False), ("postgres", False), ("postgres", True)],
    ids=["sqlite", "postgres", "postgres-setting-turned-off"],
    indirect=["url"],
)
async def test_a_connection_kept_past_its_block_cannot_write(url: str, unset: bool) -> None:
    """A handler that keeps ``conn`` (or a cursor of it) and writes after its
    ``ctx.transaction()`` block: those writes are refused. On PostgreSQL the connection
    goes back to a pool whose transactions are read-only unless tokenline begins them
    (before, a kept reference wrote, unfenced, through a pooled connection); SQLite
    closes the block's connection. Only the block's own row is there, once per job."""
    app, fates = keeper_app(url)
    async with _working(app) as store:
        ids = [
            await app.enqueue_async("sync_keeper", unset),
            await app.enqueue_async("async_keeper", unset),
        ]
        for job in await _finished(store, ids):
            assert job.state == JobState.SUCCEEDED, job
        assert sorted(_marks(url, store)) == [(ids[0], 1), (ids[1], 1)]
    refused = "ReadOnlySqlTransaction" if url.startswith("postgresql") else "ProgrammingError"
    assert fates == {
        f"sync{ids[0]}": [refused] * 3,
        f"async{ids[1]}": [refused] * (2 if url.startswith("postgresql") else 1),
    }
