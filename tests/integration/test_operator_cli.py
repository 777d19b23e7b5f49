"""The operator's commands: leases, lease release, drain, and status channel by channel.

Each refusal (an unknown worker, a wrong owner or token) exits non-zero, says what did
not match, and leaves the store as it was. The status tests inject the drill's faults
through an app of the test tree (``statusfaultapp``), never through tokenline's own code.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite._connection import connect_coord, coord_path, statements
from tokenline.stores.sqlite.store import COORD_VERSION, CQ


# -- the store side of drain ----------------------------------------------------------------
def _v1_coordination_file(main: Path) -> None:
    """A coordination file as tokenline left it before drain requests and lease ages
    (version 1), with one live worker and one held resource lease in it."""
    conn = connect_coord(coord_path(main), busy_timeout=5)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for statement in statements(CQ["schema"]):
            conn.execute(statement)
        conn.execute(
            "INSERT INTO coord.workers (id, host, pid, queues, concurrency, state, token, "
            "started_at, heartbeat_at, expires_at) "
            "VALUES ('old-worker', 'h', 1, '[\"default\"]', 4, 'ready', 3, 0, 0, 9e12)"
        )
        conn.execute(
            "INSERT INTO coord.resource_leases (resource, owner, token, expires_at) "
            "VALUES ('account:1', 'old-worker', 7, 9e12)"
        )
        conn.execute("PRAGMA coord.user_version = 1")
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_sqlite_upgrades_a_version_1_coordination_file_in_place(tmp_path: Path) -> None:
    """Opening a store whose coordination file predates drain requests and lease ages
    adds both columns in place: the worker registered before the upgrade is listed, not
    asked to drain, can be asked to, and its heartbeat (same token as before) returns
    the request; the resource lease is listed with its holder and token, its age unknown."""
    main = tmp_path / "old.db"
    _v1_coordination_file(main)

    async def run() -> tuple[Any, ...]:
        store = SQLiteStore(f"sqlite:///{main}", clock=FakeClock())
        await store.open()
        try:
            (before,) = await store.workers_list()
            marked = await store.worker_drain(worker_id="old-worker")
            beat = await store.worker_heartbeat(
                worker_id="old-worker", token=3, state="ready", in_flight=0, ttl=10
            )
            (lease,) = await store.resource_leases_list()
            held = (lease.resource, lease.owner, lease.token, lease.acquired_at)
            return before.drain_requested, marked, beat and beat.drain_requested, held
        finally:
            await store.close()

    held = ("account:1", "old-worker", 7, None)
    assert asyncio.run(run()) == (False, True, True, held)
    conn = sqlite3.connect(coord_path(main))
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == COORD_VERSION
    finally:
        conn.close()


@pytest.mark.postgres
async def test_postgres_migrates_a_0004_schema_for_drain_and_lease_ages(
    postgres_server: str, clock: FakeClock
) -> None:
    """A schema at version 4 with a live worker and a held lease is migrated on open: the
    worker can be asked to drain and its heartbeat returns it; the lease is listed with
    its holder and token, its age unknown."""
    import psycopg
    from psycopg import sql

    from tokenline.stores.postgres import SCHEMA_VERSION, PostgresStore
    from tokenline.stores.postgres._migrations import MIGRATIONS, compose

    schema = f"tl_upgrade_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(schema)
    try:
        with psycopg.connect(postgres_server, autocommit=True) as conn, conn.transaction():
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {}.schema_version (version integer PRIMARY KEY, name text "
                    "NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
                ).format(ident)
            )
            for m in MIGRATIONS[:4]:
                conn.execute(compose(m.sql, schema).encode())
                conn.execute(
                    sql.SQL("INSERT INTO {}.schema_version (version, name) VALUES (%s, %s)").format(
                        ident
                    ),
                    (m.version, m.name),
                )
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.workers (id, host, pid, queues, concurrency, state, token, "
                    "started_at, heartbeat_at, expires_at) "
                    "VALUES ('old-worker', 'h', 1, '{{default}}', 4, 'ready', 3, 0, 0, 9e12)"
                ).format(ident)
            )
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.leases (resource, owner, token, expires_at) "
                    "VALUES ('account:1', 'old-worker', 7, 9e12)"
                ).format(ident)
            )
        store = PostgresStore(f"{postgres_server}?schema={schema}", clock=clock)
        await store.open()
        try:
            (before,) = await store.workers_list()
            assert before.drain_requested is False
            assert await store.worker_drain(worker_id="old-worker") is True
            beat = await store.worker_heartbeat(
                worker_id="old-worker", token=3, state="ready", in_flight=0, ttl=10
            )
            assert beat is not None
            assert beat.drain_requested is True
            (lease,) = await store.resource_leases_list()
            assert (lease.owner, lease.token, lease.acquired_at) == ("old-worker", 7, None)
        finally:
            await store.close()
        with psycopg.connect(postgres_server) as conn:
            row = conn.execute(
                sql.SQL("SELECT max(version) FROM {}.schema_version").format(ident)
            ).fetchone()
            assert row is not None
            assert row[0] == SCHEMA_VERSION
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))
