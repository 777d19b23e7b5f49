"""The SQLite store's maintenance writes, fenced by the leader's term.

Each runs under the main file's write lock (``BEGIN IMMEDIATE``) and first reads the
maintenance lease (``leader_holds``) from the coordination file's snapshot, taken after
that lock: a rival can take the lease only once it has expired by the store's clock,
which the check has just seen it had not, and the rival's own maintenance writes then
wait for this lock. The repairs of the coordination file (an orphaned lease) are made
inside that same transaction, as a claim writes its leases.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .._repairs import (
    ABANDONED,
    ACKNOWLEDGED,
    ACKNOWLEDGED_ERROR,
    LOST,
    LOST_ERROR,
    repair_params,
)
from ..base import Drift, Inconsistency, ResourceLease, leader_refused
from ._connection import immediate, rollback

__all__ = ["SQLiteMaintenance", "check_leader"]

T = TypeVar("T")


def check_leader(
    conn: sqlite3.Connection, query: str, leader: ResourceLease | None, operation: str, now: float
) -> None:
    """Raise unless ``leader`` holds the maintenance lease (inside the caller's write
    transaction, which the error rolls back)."""
    if leader is None:
        return
    params = {
        "resource": leader.resource,
        "owner": leader.owner,
        "token": leader.token,
        "now": now,
    }
    if conn.execute(query, params).fetchone() is None:
        raise leader_refused(leader, operation)


class SQLiteMaintenance:
    """Mixin of :class:`~tokenline.stores.sqlite.SQLiteStore`: find and repair drift."""

    if TYPE_CHECKING:
        clock: Any

        def _q(self, name: str) -> str: ...

        async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _call_both(
            self, fn: Callable[[sqlite3.Connection, sqlite3.Connection], T]
        ) -> T: ...

    async def reconcile_find(
        self, *, pending_deadline: float, limit: int = 1000
    ) -> list[Inconsistency]:
        """Every disagreement of each kind, in one read transaction."""

        def run(conn: sqlite3.Connection) -> list[Inconsistency]:
            conn.execute("BEGIN")
            try:
                now = self.clock.now()
                p = {"now": now, "limit": limit, "deadline": pending_deadline}
                found = [
                    Inconsistency(Drift.JOB_UNACKNOWLEDGED, r[0], r[1], state=r[2])
                    for r in conn.execute(self._q("reconcile_unacknowledged"), p)
                ]
                found += [
                    Inconsistency(Drift.EFFECT_PENDING, r[1], r[2], key=r[0], owner=r[3])
                    for r in conn.execute(self._q("reconcile_pending_effects"), p)
                ]
                found += [
                    Inconsistency(Drift.LEASE_ORPHANED, None, r[1], key=r[0], owner=r[2])
                    for r in conn.execute(self._q("reconcile_orphan_leases"), p)
                ]
                found += [
                    Inconsistency(Drift.ATTEMPT_OPEN, r[0], r[1], owner=r[2])
                    for r in conn.execute(self._q("reconcile_open_attempts"), p)
                ]
            except BaseException:
                rollback(conn)
                raise
            conn.execute("COMMIT")
            return found

        return await self._call(run)

    async def reconcile_repair(
        self, *, leader: ResourceLease, found: Sequence[Inconsistency]
    ) -> list[bool]:
        """Every repair in one transaction, after the leader check; each conditional on
        what was seen."""

        def run(conn: sqlite3.Connection, coord: sqlite3.Connection) -> list[bool]:
            with immediate(conn):
                now = self.clock.now()
                check_leader(conn, self._q("leader_holds"), leader, "reconcile", now)
                return [self._repair(conn, coord, item, now) for item in found]

        return await self._call_both(run)

    def _repair(
        self, conn: sqlite3.Connection, coord: sqlite3.Connection, item: Inconsistency, now: float
    ) -> bool:
        p = repair_params(item, now)
        if item.kind is Drift.JOB_UNACKNOWLEDGED:
            if item.state != "running":
                if conn.execute(self._q("repair_take"), p).rowcount != 1:
                    return False
                p["token"] = item.token + 1
            if conn.execute(self._q("repair_acknowledge"), p).rowcount != 1:
                return False
            closing = {**p, "outcome": ACKNOWLEDGED, "error": ACKNOWLEDGED_ERROR}
            conn.execute(self._q("repair_attempt_close"), closing)
            return True
        if item.kind is Drift.EFFECT_PENDING:
            failing = {**p, "error": ABANDONED}
            return conn.execute(self._q("repair_effect_fail"), failing).rowcount == 1
        if item.kind is Drift.LEASE_ORPHANED:
            with immediate(coord):
                done = coord.execute(self._q("resource_lease_expire"), p).rowcount == 1
            if done:
                raised = {"resource": item.key, "token": item.token + 1}
                conn.execute(self._q("lease_token_raise"), raised)
            return done
        closing = {**p, "outcome": LOST, "error": LOST_ERROR}
        return conn.execute(self._q("repair_attempt_close"), closing).rowcount == 1
