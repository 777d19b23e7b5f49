"""The operator's commands: leases, lease release, drain, and status channel by channel.

Each refusal (an unknown worker, a wrong owner or token) exits non-zero, says what did
not match, and leaves the store as it was. The status tests inject the drill's faults
through an app of the test tree (``statusfaultapp``), never through tokenline's own code.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from tokenline._clock import FakeClock
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite._connection import connect_coord, coord_path, statements
from tokenline.stores.sqlite.store import COORD_VERSION, CQ


# -- the store side of drain ----------------------------------------------------------------
def _v1_coordination_file(main: Path) -> None:
    """A coordination file as tokenline left it before drain requests (version 1), with
    one live worker in it."""
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
        conn.execute("PRAGMA coord.user_version = 1")
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_sqlite_upgrades_a_version_1_coordination_file_for_drain(tmp_path: Path) -> None:
    """Opening a store whose coordination file predates drain requests adds the column
    in place: the worker registered before the upgrade is listed, not asked to drain,
    can be asked to, and its heartbeat (same token as before) returns the request."""
    main = tmp_path / "old.db"
    _v1_coordination_file(main)

    async def run() -> tuple[bool, bool, bool | None]:
        store = SQLiteStore(f"sqlite:///{main}", clock=FakeClock())
        await store.open()
        try:
            (before,) = await store.workers_list()
            marked = await store.worker_drain(worker_id="old-worker")
            beat = await store.worker_heartbeat(
                worker_id="old-worker", token=3, state="ready", in_flight=0, ttl=10
            )
            return before.drain_requested, marked, beat and beat.drain_requested
        finally:
            await store.close()

    assert asyncio.run(run()) == (False, True, True)
    conn = sqlite3.connect(coord_path(main))
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == COORD_VERSION
    finally:
        conn.close()
