"""Upgrading a store made before the ledger: SQLite 1 -> 2, PostgreSQL migration 0001 -> 0002.

The jobs already stored survive, and the ledger works on the upgraded store.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from pg_schema import schema_at_version
from tokenline._clock import FakeClock
from tokenline._jobs import JobState, NewJob, Unique
from tokenline._records import Start
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite._connection import statements
from tokenline.stores.sqlite.ledger import LQ
from tokenline.stores.sqlite.store import SCHEMA_VERSION, Q


def _v1_sqlite_file(path: Path) -> None:
    """A file as tokenline with schema version 1 left it, with one queued job."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for statement in statements(Q["schema"]):
            conn.execute(statement)
        conn.execute(
            "INSERT INTO tokenline_jobs (queue, task, args, idempotency_key, run_at, "
            "max_attempts, state, created_at, updated_at) "
            "VALUES ('default', 't', '[]', 'old:1', 0, 5, 'queued', 0, 0)"
        )
        conn.execute("PRAGMA user_version = 1")
        conn.execute("COMMIT")
    finally:
        conn.close()


async def test_sqlite_upgrades_a_version_1_file_in_place(tmp_path: Path, clock: FakeClock) -> None:
    """Opening a version-1 file adds the ledger tables and sets version 2; the old job
    is still there and the new features work on it."""
    path = tmp_path / "old.db"
    _v1_sqlite_file(path)
    store = SQLiteStore(f"sqlite:///{path}", clock=clock)
    await store.open()
    try:
        (job,) = await store.jobs_list()
        assert (job.idempotency_key, job.state) == ("old:1", JobState.QUEUED)
        ids = await store.jobs_enqueue(
            jobs=[NewJob("default", "t", "[]", "new:1", unique=Unique.ALWAYS)] * 2
        )
        assert ids[0] == ids[1] != job.id
        (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=10)
        begin = await store.effect_begin(lease=claimed.lease, key="k")
        assert begin.start is Start.RUN
    finally:
        await store.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()


def _v2_sqlite_file(path: Path) -> None:
    """A version-2 file: leases and workers in the main file, a job running under a
    lease, and a resource lease at token 7."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for script in (Q["schema"], LQ["schema_v2"]):
            for statement in statements(script):
                conn.execute(statement)
        conn.execute(
            "INSERT INTO tokenline_jobs (queue, task, args, run_at, max_attempts, state, "
            "attempt, lease_owner, lease_token, lease_expires_at, created_at, updated_at) "
            "VALUES ('default', 't', '[]', 0, 5, 'running', 1, 'old-worker', 3, 9e12, 0, 0)"
        )
        conn.execute(
            "INSERT INTO tokenline_leases (resource, owner, token, expires_at) "
            "VALUES ('account:1', 'old-worker', 7, 9e12)"
        )
        conn.execute("PRAGMA user_version = 2")
        conn.execute("COMMIT")
    finally:
        conn.close()


async def test_sqlite_upgrade_to_the_coordination_file_keeps_tokens_rising(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A version-2 file gains its coordination file: a resource lease's next token is
    above every token issued before the upgrade, and a job left running by a worker of
    the old version has no live lease any more, so it is rescued with a higher token."""
    path = tmp_path / "v2.db"
    _v2_sqlite_file(path)
    store = SQLiteStore(f"sqlite:///{path}", clock=clock)
    await store.open()
    try:
        lease = await store.resource_lease_acquire(resource="account:1", owner="new", ttl=10)
        assert lease is not None
        assert lease.token == 8
        report = await store.jobs_rescue()
        (job,) = await store.jobs_list()
        assert list(report.requeued) == [job.id]
        assert (job.state, job.lease_token) == (JobState.QUEUED, 4)
    finally:
        await store.close()


@pytest.mark.postgres
async def test_postgres_migrates_a_0001_schema_to_0002(
    postgres_server: str, postgres_schema: str, postgres_url: str, clock: FakeClock
) -> None:
    """A schema at version 1 (with a job in it) is migrated to 2 on open."""
    from tokenline.stores.postgres import SCHEMA_VERSION as PG_SCHEMA_VERSION
    from tokenline.stores.postgres import PostgresStore

    schema = sql.Identifier(postgres_schema)
    with psycopg.connect(postgres_server, autocommit=True) as conn, conn.transaction():
        schema_at_version(conn, postgres_schema, 1)
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.jobs (queue, task, args, run_at, max_attempts, state, "
                "created_at, updated_at) VALUES ('default', 't', '[]', 0, 5, 'queued', 0, 0)"
            ).format(schema)
        )
    store = PostgresStore(postgres_url, clock=clock)
    await store.open()
    try:
        assert len(await store.jobs_list()) == 1
        assert await store.duplicates_list() == []
    finally:
        await store.close()
    with psycopg.connect(postgres_server) as conn:
        query = sql.SQL("SELECT max(version) FROM {}.schema_version").format(schema)
        row = conn.execute(query).fetchone()
        assert row is not None
        assert row[0] == PG_SCHEMA_VERSION
