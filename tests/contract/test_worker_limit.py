"""A worker's adaptive concurrency limit on its membership row, and the upgrades that
bring it (and the priority-aging index) to stores made before them: SQLite coordination
file 3 -> 4 and main file 4 -> 5, PostgreSQL migrations 0006 -> 0008."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from pg_schema import schema_at_version
from tokenline._clock import FakeClock
from tokenline._jobs import WorkerRecord
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite._connection import connect_coord, coord_path, statements
from tokenline.stores.sqlite.ledger import LQ
from tokenline.stores.sqlite.store import COORD_VERSION, CQ, SCHEMA_VERSION, Q


def _record(wid: str = "w-1", limit: int | None = None) -> WorkerRecord:
    rec = WorkerRecord(wid, "host", 1, ("default",), 10, "ready", 0, 0.0, 0.0, 0.0)
    return dataclasses.replace(rec, concurrency_limit=limit)


async def test_the_heartbeat_keeps_the_workers_concurrency_limit(
    store: Any, clock: FakeClock
) -> None:
    """A heartbeat's concurrency_limit is kept on the membership row, returned by the
    heartbeat and by workers_list; a heartbeat without one keeps the last; a new
    registration starts with its record's."""
    rec = await store.worker_register(record=_record(), ttl=10)
    assert rec.concurrency_limit is None
    beat = {"worker_id": rec.id, "token": rec.token, "state": "processing", "in_flight": 7}
    hb = await store.worker_heartbeat(**beat, ttl=10, concurrency_limit=7)
    assert (hb.concurrency_limit, hb.in_flight, hb.concurrency) == (7, 7, 10)
    (listed,) = await store.workers_list()
    assert listed.concurrency_limit == 7
    clock.advance(1)
    assert (await store.worker_heartbeat(**beat, ttl=10)).concurrency_limit == 7
    lower = await store.worker_heartbeat(**beat, ttl=10, concurrency_limit=3)
    assert lower.concurrency_limit == 3
    (listed,) = await store.workers_list()
    assert listed.concurrency_limit == 3
    again = await store.worker_register(record=_record(limit=10), ttl=10)
    assert again.concurrency_limit == 10
    fresh = await store.worker_register(record=_record(), ttl=10)
    assert fresh.concurrency_limit is None


async def test_a_lost_membership_does_not_take_the_limit(store: Any, clock: FakeClock) -> None:
    """A heartbeat with a stale token, or after the membership expired, is refused and
    leaves the row's limit as it was."""
    rec = await store.worker_register(record=_record(), ttl=5)
    beat = {"worker_id": rec.id, "state": "ready", "in_flight": 0, "ttl": 5}
    assert await store.worker_heartbeat(**beat, token=rec.token, concurrency_limit=4)
    assert await store.worker_heartbeat(**beat, token=rec.token + 1, concurrency_limit=9) is None
    clock.advance(6)
    assert await store.worker_heartbeat(**beat, token=rec.token, concurrency_limit=9) is None
    (listed,) = await store.workers_list()
    assert listed.concurrency_limit == 4


# -- upgrades -----------------------------------------------------------------------------------
def _v3_coordination_file(main: Path) -> None:
    """A coordination file as tokenline left it before concurrency limits (version 3),
    with one live worker in it."""
    conn = connect_coord(coord_path(main), busy_timeout=5)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for script in (CQ["schema"], CQ["schema_v2"], CQ["schema_v3"]):
            for statement in statements(script):
                conn.execute(statement)
        conn.execute(
            "INSERT INTO coord.workers (id, host, pid, queues, concurrency, state, token, "
            "started_at, heartbeat_at, expires_at) "
            "VALUES ('old-worker', 'h', 1, '[\"default\"]', 4, 'ready', 3, 0, 0, 9e12)"
        )
        conn.execute("PRAGMA coord.user_version = 3")
        conn.execute("COMMIT")
    finally:
        conn.close()


def _v4_main_file(path: Path) -> None:
    """A main file as tokenline left it before priority aging (version 4), with two
    queued jobs: priority 0 enqueued at 0, priority 5 at 100."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for script in (Q["schema"], LQ["schema_v2"], Q["schema_v3"], Q["schema_v4"]):
            for statement in statements(script):
                conn.execute(statement)
        conn.execute(
            "INSERT INTO tokenline_jobs (queue, task, args, priority, run_at, max_attempts, "
            "state, created_at, updated_at) VALUES "
            "('default', 'low', '[]', 0, 0, 5, 'queued', 0, 0), "
            "('default', 'high', '[]', 5, 100, 5, 'queued', 100, 100)"
        )
        conn.execute("PRAGMA user_version = 4")
        conn.execute("COMMIT")
    finally:
        conn.close()


async def test_sqlite_upgrades_both_files_for_limits_and_aging_in_place(tmp_path: Path) -> None:
    """Opening a store whose coordination file predates concurrency limits (3) and whose
    main file predates priority aging (4) upgrades both in place: the worker registered
    before is listed without a limit, its heartbeat (same token) sets one; the jobs
    stored before are claimed by effective priority through the new index."""
    main = tmp_path / "old.db"
    _v4_main_file(main)
    _v3_coordination_file(main)
    clock = FakeClock(start=110.0)  # low has waited 110 s, high 10 s
    store = SQLiteStore(f"sqlite:///{main}", clock=clock)
    await store.open()
    try:
        (before,) = await store.workers_list()
        assert (before.id, before.concurrency_limit) == ("old-worker", None)
        beat = await store.worker_heartbeat(
            worker_id="old-worker", token=3, state="ready", in_flight=0, ttl=10, concurrency_limit=2
        )
        assert beat is not None
        assert beat.concurrency_limit == 2
        claimed = await store.jobs_claim(
            owner="w", queues=["default"], limit=2, ttl=10, priority_aging=10.0
        )
        # low: 0 + 11 points; high: 5 + 1
        assert [c.job.task for c in claimed] == ["low", "high"]
    finally:
        await store.close()
    conn = sqlite3.connect(main)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        index = "SELECT 1 FROM sqlite_master WHERE name = 'tokenline_jobs_ready_age'"
        assert conn.execute(index).fetchone() == (1,)
    finally:
        conn.close()
    conn = sqlite3.connect(coord_path(main))
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == COORD_VERSION
    finally:
        conn.close()


@pytest.mark.postgres
async def test_postgres_migrates_a_0006_schema_for_limits_and_aging(
    postgres_server: str, postgres_schema: str, postgres_url: str
) -> None:
    """A schema at version 6 with a live worker and two queued jobs is migrated on open:
    the worker is listed without a limit and its heartbeat (same token) sets one; the
    jobs are claimed by effective priority, the oldest ready one found through the new
    index."""
    import psycopg
    from psycopg import sql

    from tokenline.stores.postgres import SCHEMA_VERSION as PG_SCHEMA_VERSION
    from tokenline.stores.postgres import PostgresStore

    ident = sql.Identifier(postgres_schema)
    with psycopg.connect(postgres_server, autocommit=True) as conn, conn.transaction():
        schema_at_version(conn, postgres_schema, 6)
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.workers (id, host, pid, queues, concurrency, state, token, "
                "started_at, heartbeat_at, expires_at) "
                "VALUES ('old-worker', 'h', 1, '{{default}}', 4, 'ready', 3, 0, 0, 9e12)"
            ).format(ident)
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.jobs (queue, task, args, priority, run_at, max_attempts, "
                "state, created_at, updated_at) VALUES "
                "('default', 'low', '[]', 0, 0, 5, 'queued', 0, 0), "
                "('default', 'high', '[]', 5, 100, 5, 'queued', 100, 100)"
            ).format(ident)
        )
    store = PostgresStore(postgres_url, clock=FakeClock(start=110.0))
    await store.open()
    try:
        (before,) = await store.workers_list()
        assert (before.id, before.concurrency_limit) == ("old-worker", None)
        beat = await store.worker_heartbeat(
            worker_id="old-worker", token=3, state="ready", in_flight=0, ttl=10, concurrency_limit=2
        )
        assert beat is not None
        assert beat.concurrency_limit == 2
        claimed = await store.jobs_claim(
            owner="w", queues=["default"], limit=2, ttl=10, priority_aging=10.0
        )
        assert [c.job.task for c in claimed] == ["low", "high"]
    finally:
        await store.close()
    with psycopg.connect(postgres_server) as conn:
        row = conn.execute(
            sql.SQL("SELECT max(version) FROM {}.schema_version").format(ident)
        ).fetchone()
        assert row is not None
        assert row[0] == PG_SCHEMA_VERSION
        index = conn.execute(
            "SELECT 1 FROM pg_indexes WHERE schemaname = %s AND indexname = 'jobs_ready_age'",
            (postgres_schema,),
        ).fetchone()
        assert index == (1,)
