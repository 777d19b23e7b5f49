"""The PostgreSQL store's retention and schedule writes: pruning batches and periodic marks.

Each call is one transaction that runs ``leader_holds`` first (``SELECT … FOR SHARE`` of
the maintenance lease row with the leader's owner and token, unexpired by the store's
clock): until it commits, no takeover can issue a newer token, so a deposed leader
writes nothing and a current one's write is never overtaken by its successor's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg import AsyncConnection
from psycopg.rows import tuple_row

from ..._errors import StaleTokenError
from ..._jobs import NewJob
from ..base import PruneKind, ResourceLease

__all__ = ["PostgresRetention"]

T = TypeVar("T")

_QUERY = {
    PruneKind.FINISHED: "prune_finished",
    PruneKind.DEAD: "prune_dead",
    PruneKind.STALE_COMMITS: "prune_stale_commits",
    PruneKind.DUPLICATES: "prune_duplicates",
}


class PostgresRetention:
    """Mixin of :class:`~tokenline.stores.postgres.PostgresStore`: the leader's writes."""

    if TYPE_CHECKING:

        def _q(self, name: str) -> str: ...

        def _now(self) -> float | None: ...

        async def _call(self, fn: Callable[[AsyncConnection[Any]], Awaitable[T]]) -> T: ...

        def _enqueue_params(self, jobs: Sequence[NewJob], *, notify: bool) -> dict[str, Any]: ...

    async def _leader_check(
        self, conn: AsyncConnection[Any], leader: ResourceLease, operation: str
    ) -> None:
        cur = conn.cursor(row_factory=tuple_row)
        params = {
            "resource": leader.resource,
            "owner": leader.owner,
            "token": leader.token,
            "now": self._now(),
        }
        await cur.execute(self._q("leader_holds"), params)
        if await cur.fetchone() is None:
            raise StaleTokenError(resource=leader.resource, token=leader.token, operation=operation)

    async def maintenance_prune(
        self, *, leader: ResourceLease, kind: PruneKind, before: float, limit: int
    ) -> int:
        """Delete one batch of ``kind`` in one short transaction; see the seam."""
        query = self._q(_QUERY[PruneKind(kind)])
        params = {"before": before, "limit": limit, "now": self._now()}

        async def run(conn: AsyncConnection[Any]) -> int:
            async with conn.transaction():
                await self._leader_check(conn, leader, "prune")
                cur = conn.cursor()
                await cur.execute(query, params)
                return cur.rowcount

        return await self._call(run)

    async def maintenance_prunable(self, *, kind: PruneKind, before: float) -> int:
        """How many rows of ``kind`` are older than ``before``."""
        query = self._q(_QUERY[PruneKind(kind)] + "_count")

        async def run(conn: AsyncConnection[Any]) -> int:
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(query, {"before": before})
            row = await cur.fetchone()
            return int(row[0]) if row else 0

        return await self._call(run)

    async def schedule_advance(
        self, *, leader: ResourceLease, schedule: str, instant: float, job: NewJob | None
    ) -> bool:
        """Advance the mark and enqueue ``job`` in one transaction, or do nothing."""

        async def run(conn: AsyncConnection[Any]) -> bool:
            async with conn.transaction():
                await self._leader_check(conn, leader, "schedule")
                cur = conn.cursor(row_factory=tuple_row)
                params = {"name": schedule, "instant": instant, "now": self._now()}
                await cur.execute(self._q("schedule_advance"), params)
                if await cur.fetchone() is None:
                    return False
                if job is not None:
                    await cur.execute(self._q("enqueue"), self._enqueue_params([job], notify=True))
                return True

        return await self._call(run)

    async def schedule_marks(self) -> dict[str, float]:
        """Every schedule's mark."""

        async def run(conn: AsyncConnection[Any]) -> dict[str, float]:
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(self._q("schedule_marks"))
            return {r[0]: float(r[1]) for r in await cur.fetchall()}

        return await self._call(run)
