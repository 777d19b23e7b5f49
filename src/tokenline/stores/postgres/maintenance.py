"""The PostgreSQL store's maintenance writes, fenced by the leader's term.

Each runs in one transaction that first locks the maintenance lease row ``FOR SHARE``
while checking that the leader still holds it (``leader_holds``): a rival's acquire,
an UPDATE of that row, waits for the transaction to end, so no new term can begin
while a deposed leader's write is in flight; and once a new term has begun, the old
leader's check matches nothing and its write is refused, having changed nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg import AsyncConnection, AsyncCursor
from psycopg.rows import TupleRow, tuple_row

from .._repairs import (
    ABANDONED,
    ACKNOWLEDGED,
    ACKNOWLEDGED_ERROR,
    LOST,
    LOST_ERROR,
    repair_params,
)
from ..base import Drift, Inconsistency, ResourceLease, leader_refused

__all__ = ["PostgresMaintenance", "check_leader"]

T = TypeVar("T")


async def check_leader(
    cur: AsyncCursor[TupleRow],
    query: str,
    leader: ResourceLease | None,
    operation: str,
    now: float | None,
) -> None:
    """Raise unless ``leader`` holds the maintenance lease (inside the caller's open
    transaction, which the error rolls back), and keep the lease row from changing
    until that transaction ends."""
    if leader is None:
        return
    params = {
        "resource": leader.resource,
        "owner": leader.owner,
        "token": leader.token,
        "now": now,
    }
    await cur.execute(query, params)
    if await cur.fetchone() is None:
        raise leader_refused(leader, operation)


class PostgresMaintenance:
    """Mixin of :class:`~tokenline.stores.postgres.PostgresStore`: find and repair drift."""

    if TYPE_CHECKING:

        def _q(self, name: str) -> str: ...

        def _now(self) -> float | None: ...

        async def _call(self, fn: Callable[[AsyncConnection[Any]], Awaitable[T]]) -> T: ...

    async def reconcile_find(
        self, *, pending_deadline: float, limit: int = 1000
    ) -> list[Inconsistency]:
        """Every disagreement of each kind, read in one transaction."""

        async def run(conn: AsyncConnection[Any]) -> list[Inconsistency]:
            cur = conn.cursor(row_factory=tuple_row)
            p = {"now": self._now(), "limit": limit, "deadline": pending_deadline}
            async with conn.transaction():
                await cur.execute(self._q("reconcile_unacknowledged"), p)
                found = [
                    Inconsistency(Drift.JOB_UNACKNOWLEDGED, r[0], r[1], state=r[2])
                    for r in await cur.fetchall()
                ]
                await cur.execute(self._q("reconcile_pending_effects"), p)
                found += [
                    Inconsistency(Drift.EFFECT_PENDING, r[1], r[2], key=r[0], owner=r[3])
                    for r in await cur.fetchall()
                ]
                await cur.execute(self._q("reconcile_orphan_leases"), p)
                found += [
                    Inconsistency(Drift.LEASE_ORPHANED, None, r[1], key=r[0], owner=r[2])
                    for r in await cur.fetchall()
                ]
                await cur.execute(self._q("reconcile_open_attempts"), p)
                found += [
                    Inconsistency(Drift.ATTEMPT_OPEN, r[0], r[1], owner=r[2])
                    for r in await cur.fetchall()
                ]
            return found

        return await self._call(run)

    async def reconcile_repair(
        self, *, leader: ResourceLease, found: Sequence[Inconsistency]
    ) -> list[bool]:
        """Every repair in one transaction, after the leader check; each conditional on
        what was seen."""

        async def run(conn: AsyncConnection[Any]) -> list[bool]:
            cur = conn.cursor(row_factory=tuple_row)
            async with conn.transaction():
                now = self._now()
                await check_leader(cur, self._q("leader_holds"), leader, "reconcile", now)
                return [await self._repair(cur, item, now) for item in found]

        return await self._call(run)

    async def _repair(
        self, cur: AsyncCursor[TupleRow], item: Inconsistency, now: float | None
    ) -> bool:
        p = repair_params(item, now)

        async def count(query: str, params: dict[str, Any]) -> int:
            await cur.execute(self._q(query), params)
            return cur.rowcount

        if item.kind is Drift.JOB_UNACKNOWLEDGED:
            if item.state != "running":
                if await count("repair_take", p) != 1:
                    return False
                p["token"] = item.token + 1
            if await count("repair_acknowledge", p) != 1:
                return False
            closing = {**p, "outcome": ACKNOWLEDGED, "error": ACKNOWLEDGED_ERROR}
            await count("repair_attempt_close", closing)
            return True
        if item.kind is Drift.EFFECT_PENDING:
            return await count("repair_effect_fail", {**p, "error": ABANDONED}) == 1
        if item.kind is Drift.LEASE_ORPHANED:
            return await count("resource_lease_expire", p) == 1
        closing = {**p, "outcome": LOST, "error": LOST_ERROR}
        return await count("repair_attempt_close", closing) == 1
