"""What only the SQLite store promises: its file, its schema, its trigger, its outbox."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tokenline import App, SchemaVersionError, StoreCorruptError, StoreUnavailableError
from tokenline._clock import FakeClock
from tokenline._errors import StoreError
from tokenline._jobs import JobState, NewJob
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite.store import SCHEMA_VERSION


def job() -> NewJob:
    return NewJob(queue="default", task="t", args="[]")


async def test_missing_directory_is_a_clear_unavailable_error(tmp_path: Path) -> None:
    """A store path in a directory that does not exist names that directory."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'nope' / 'x.db'}")
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        await store.open()


async def test_corrupt_file_is_reported_and_not_modified(tmp_path: Path) -> None:
    """A file that is not SQLite raises StoreCorruptError and keeps its bytes."""
    path = tmp_path / "bad.db"
    path.write_bytes(b"not a database " * 200)
    before = path.read_bytes()
    with pytest.raises(StoreCorruptError, match="not a usable tokenline store"):
        await SQLiteStore(f"sqlite:///{path}").open()
    assert path.read_bytes() == before


async def test_newer_schema_is_refused_with_a_hint(tmp_path: Path) -> None:
    """A file written by a newer tokenline is refused, not downgraded."""
    path = tmp_path / "new.db"
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(SchemaVersionError, match="upgrade tokenline"):
        await SQLiteStore(f"sqlite:///{path}").open()


def test_url_without_a_file_is_refused() -> None:
    """``sqlite:///:memory:`` cannot be shared by worker processes: say so."""
    with pytest.raises(StoreError, match="memory://"):
        SQLiteStore("sqlite:///:memory:")


async def test_reopening_keeps_data_and_schema(tmp_path: Path) -> None:
    """Opening an existing store does not recreate or lose anything."""
    url = f"sqlite:///{tmp_path / 'keep.db'}"
    first = SQLiteStore(url)
    await first.open()
    (jid,) = await first.jobs_enqueue(jobs=[job()])
    await first.close()
    second = SQLiteStore(url)
    await second.open()
    assert (await second.job_get(job_id=jid)).state is JobState.QUEUED
    await second.close()


async def test_the_store_itself_refuses_a_backwards_state_move(tmp_path: Path) -> None:
    """Even raw SQL cannot move a succeeded job back to running: the trigger aborts."""
    path = tmp_path / "mono.db"
    store = SQLiteStore(f"sqlite:///{path}", clock=FakeClock())
    await store.open()
    await store.jobs_enqueue(jobs=[job()])
    (c,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=5)
    await store.job_complete(lease=c.lease)
    await store.close()
    with sqlite3.connect(path) as conn, pytest.raises(sqlite3.IntegrityError, match="illegal"):
        conn.execute("UPDATE tokenline_jobs SET state = 'running' WHERE id = ?", (c.job.id,))


def test_outbox_enqueue_exists_only_if_the_callers_transaction_commits(tmp_path: Path) -> None:
    """enqueue(connection=conn) joins the caller's transaction: rollback leaves no job."""
    path = tmp_path / "outbox.db"
    app = App(f"sqlite:///{path}")

    @app.task(name="ship")
    def ship(ctx: object, order: int) -> None:
        """A task to enqueue."""

    app.run(lambda s: s.queues_stats())  # creates the schema
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE orders (id INTEGER)")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO orders VALUES (1)")
    app.enqueue("ship", 1, connection=conn)
    conn.execute("ROLLBACK")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO orders VALUES (2)")
    jid = app.enqueue("ship", 2, connection=conn)
    conn.execute("COMMIT")
    conn.close()
    jobs = app.run(lambda s: s.jobs_list())
    app.close()
    assert [(j.id, j.args) for j in jobs] == [(jid, '{"args":[2],"kwargs":{}}')]


def test_outbox_needs_an_open_transaction(tmp_path: Path) -> None:
    """A connection outside a transaction would commit the job on its own: refused."""
    path = tmp_path / "outbox2.db"
    app = App(f"sqlite:///{path}")

    @app.task(name="ship")
    def ship(ctx: object) -> None:
        """A task to enqueue."""

    app.run(lambda s: s.queues_stats())
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(StoreError, match="open transaction"):
        app.enqueue("ship", connection=conn)
    conn.close()
    assert app.run(lambda s: s.jobs_list()) == []
    app.close()
