"""One handler, every store: the same sync and async handler modules (transaction,
effect, fenced write, resource lease) run unchanged on memory, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenline import App, Worker, WorkerSettings
from tokenline._jobs import JobState

from . import handlers

DEADLINE = 60.0
SETTINGS = WorkerSettings(
    queues=("ship",), lease_ttl=3, renew_interval=0.5, poll_interval=0.05, concurrency=4
)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store of each kind."""
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'handlers.db'}"
    else:
        import psycopg

        server: str = request.getfixturevalue("postgres_server")
        schema = f"tl_hd_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        yield f"{server}?schema={schema}&options=-c%20search_path%3D{schema}"
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def create_shipments(app: App) -> None:
    """The business table, in the store's own database."""
    if app.url.startswith("memory:"):
        app.open_store().database.connection.execute(handlers.SHIPMENTS)  # type: ignore[attr-defined]
    elif app.url.startswith("sqlite:"):
        with sqlite3.connect(app.url[len("sqlite:///") :]) as conn:
            conn.execute(handlers.SHIPMENTS)
    else:
        import psycopg

        with psycopg.connect(app.url.split("?")[0], autocommit=True) as conn:
            schema = app.url.split("schema=")[1].split("&")[0]
            conn.execute(f"SET search_path TO {schema}")
            conn.execute(handlers.SHIPMENTS)


def shipments(app: App) -> list[tuple[int, int, int, str]]:
    """Every shipment row."""
    sql = "SELECT order_id, token, lease_token, kind FROM shipments ORDER BY order_id"
    if app.url.startswith("memory:"):
        conn = app.open_store().database.connection  # type: ignore[attr-defined]
        return [tuple(r) for r in conn.execute(sql).fetchall()]
    if app.url.startswith("sqlite:"):
        with sqlite3.connect(app.url[len("sqlite:///") :]) as conn:
            return [tuple(r) for r in conn.execute(sql).fetchall()]
    import psycopg

    with psycopg.connect(app.url.split("?")[0], autocommit=True) as conn:
        schema = app.url.split("schema=")[1].split("&")[0]
        conn.execute(f"SET search_path TO {schema}")
        return [tuple(r) for r in conn.execute(sql).fetchall()]


async def test_the_same_handlers_run_on_every_store(url: str) -> None:
    """Both handlers ship their orders on this store: each job succeeds on its first
    attempt, its one shipment row carries its token and its account lease's token, and
    the ledger holds one completed effect per order."""
    app = App(url)
    handlers.register(app)
    await asyncio.to_thread(create_shipments, app)
    # The worker's store is opened before the worker runs: the test reads it from the
    # start, and on a slow machine run() had not opened it yet ("not open" errors).
    store = app.open_store(timeout=SETTINGS.call_timeout)
    await store.open()
    worker = Worker(app, SETTINGS, store=store)
    run = asyncio.create_task(worker.run())
    try:
        ids = {}
        for order in range(1, 7):
            task = "ship" if order % 2 else "ship_async"
            ids[order] = await app.enqueue_async(task, order)

        async def done() -> list[JobState]:
            while True:
                jobs = [await worker.store.job_get(job_id=j) for j in ids.values()]
                if all(j.state.finished for j in jobs):
                    return [j.state for j in jobs]
                await asyncio.sleep(0.05)

        states = await asyncio.wait_for(done(), DEADLINE)
        assert states == [JobState.SUCCEEDED] * len(ids), [
            (await worker.store.job_get(job_id=j)).last_error for j in ids.values()
        ]
        rows = await asyncio.to_thread(shipments, app)
        assert [(r[0], r[3]) for r in rows] == [
            (o, "sync" if o % 2 else "async") for o in range(1, 7)
        ]
        for order, token, lease_token, _ in rows:
            job = await worker.store.job_get(job_id=ids[order])
            assert (token, job.attempt) == (job.lease_token, 1)
            assert lease_token >= 1
        effects = await worker.store.effects_list(limit=100)
        assert sorted(e.key for e in effects) == sorted(f"label:{o}" for o in range(1, 7))
        assert {e.status.value for e in effects} == {"completed"}
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(run, DEADLINE)
        app.close()
