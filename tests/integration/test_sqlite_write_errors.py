"""A write that fails on SQLite (a full disk, a commit refused) reports its own error and
leaves no transaction, and so no write lock, behind.

A full disk is made with ``PRAGMA max_page_count``: the file may not grow past the size
it has, so the next write that needs a new page fails with SQLite's "database or disk is
full", as it does when the disk has no room left. SQLite rolls the transaction back
itself on that error; a ``ROLLBACK`` sent after it fails with "no transaction is
active", and must not be the error the caller sees.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tokenline import StoreUnavailableError
from tokenline._jobs import JobState, NewJob
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite._connection import immediate

#: Enough data that the file must grow by many pages.
BIG = "x" * 4000


def job(args: str = "[]") -> NewJob:
    return NewJob(queue="default", task="t", args=args)


def _connect(path: Path, journal: str = "wal") -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=0, check_same_thread=False)
    conn.execute(f"PRAGMA journal_mode = {journal}")
    conn.execute("CREATE TABLE IF NOT EXISTS t (x TEXT)")
    return conn


def _can_write(path: Path) -> bool:
    """Whether another connection can take the write lock at once."""
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        other.close()


def test_a_full_disk_in_a_write_is_the_error_raised(tmp_path: Path) -> None:
    """SQLite has already rolled back: the "disk is full" error comes out, not the
    failed ROLLBACK's, and the lock is free."""
    path = tmp_path / "full.db"
    conn = _connect(path)
    conn.execute("PRAGMA max_page_count = 1")  # no larger than it is now

    def fill() -> None:
        with immediate(conn):
            for _ in range(100):
                conn.execute("INSERT INTO t VALUES (?)", (BIG,))

    with pytest.raises(sqlite3.OperationalError, match="full"):
        fill()
    assert not conn.in_transaction
    assert _can_write(path)
    conn.execute("PRAGMA max_page_count = 1073741823")
    with immediate(conn):
        conn.execute("INSERT INTO t VALUES ('after')")
    assert conn.execute("SELECT x FROM t").fetchall() == [("after",)]


def test_a_commit_that_fails_leaves_no_transaction_open(tmp_path: Path) -> None:
    """A COMMIT refused with the transaction still open (a reader's lock on a
    rollback-journal file) is rolled back: a connection the store keeps must not hold
    the write lock afterwards."""
    path = tmp_path / "journal.db"
    conn = _connect(path, journal="delete")
    reader = sqlite3.connect(path, isolation_level=None, timeout=0)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM t").fetchone()  # holds a shared lock
    with pytest.raises(sqlite3.OperationalError, match="locked"), immediate(conn):
        conn.execute("INSERT INTO t VALUES ('never')")
    assert not conn.in_transaction
    reader.execute("COMMIT")
    reader.close()
    assert _can_write(path)
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)


async def test_a_store_on_a_full_disk_says_so_and_keeps_its_jobs(tmp_path: Path) -> None:
    """An enqueue that fills the disk fails with StoreUnavailableError saying the disk
    is full; the jobs already stored are intact, and once there is room again the same
    store takes the batch."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}")
    await store.open()
    try:
        kept = await store.jobs_enqueue(jobs=[job() for _ in range(3)])
        # The store thread's connection takes batches this size; cap its file there.
        await store._call(lambda conn: conn.execute("PRAGMA max_page_count = 1"))
        batch = [job(f'["{BIG}"]') for _ in range(200)]
        with pytest.raises(StoreUnavailableError, match="full") as err:
            await store.jobs_enqueue(jobs=batch)
        assert "free space" in str(err.value)
        assert "cannot rollback" not in str(err.value)
        for jid in kept:
            assert (await store.job_get(job_id=jid)).state is JobState.QUEUED
        await store._call(lambda conn: conn.execute("PRAGMA max_page_count = 1073741823"))
        ids = await store.jobs_enqueue(jobs=batch)
        assert len(ids) == 200
        assert (await store.job_get(job_id=ids[-1])).state is JobState.QUEUED
    finally:
        await store.close()


async def test_a_full_disk_inside_a_fenced_transaction_is_the_callers_error(
    tmp_path: Path,
) -> None:
    """The caller's own write fails on a full disk inside ``ctx.transaction()``: that
    error is the one raised, and the job is still running, not completed."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}")
    await store.open()
    try:
        await store.jobs_enqueue(jobs=[job()])
        (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=60)

        async def fill() -> None:
            async with store.fenced_transaction(lease=claimed.lease) as conn:
                conn.execute("CREATE TABLE IF NOT EXISTS user_rows (x TEXT)")
                conn.execute("PRAGMA max_page_count = 1")
                for _ in range(100):
                    conn.execute("INSERT INTO user_rows VALUES (?)", (BIG,))

        with pytest.raises(sqlite3.OperationalError, match="full"):
            await fill()
        assert (await store.job_get(job_id=claimed.job.id)).state is JobState.RUNNING
        async with store.fenced_transaction(lease=claimed.lease):
            pass
        assert (await store.job_get(job_id=claimed.job.id)).state is JobState.SUCCEEDED
    finally:
        await store.close()
