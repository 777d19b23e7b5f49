"""The SQLite store's retention and schedule writes: pruning batches and periodic marks.

Each call is one ``BEGIN IMMEDIATE`` transaction on the main file that runs
``leader_holds`` first (see ``queries.sql``), so a deposed leader writes nothing.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..._errors import StaleTokenError
from ..._jobs import JobState, NewJob
from .._sql import load_queries
from ..base import PruneKind, ResourceLease
from ._connection import immediate
from .ledger import insert_job

if TYPE_CHECKING:
    from ..._clock import Clock

__all__ = ["SQLiteRetention"]

T = TypeVar("T")
Q = load_queries(__name__.rpartition(".")[0])

_STATES = {
    PruneKind.FINISHED: [JobState.SUCCEEDED.value, JobState.CANCELLED.value],
    PruneKind.DEAD: [JobState.DEAD.value],
}
_AUDIT = {
    PruneKind.STALE_COMMITS: ("prune_stale_commits", "prune_stale_commits_count"),
    PruneKind.DUPLICATES: ("prune_duplicates", "prune_duplicates_count"),
}


class SQLiteRetention:
    """Mixin of :class:`~tokenline.stores.sqlite.SQLiteStore`: the leader's writes."""

    if TYPE_CHECKING:
        clock: Clock

        async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        def _q(self, name: str) -> str: ...

    def _leader_check(
        self, conn: sqlite3.Connection, leader: ResourceLease, operation: str, now: float
    ) -> None:
        params = {
            "resource": leader.resource,
            "owner": leader.owner,
            "token": leader.token,
            "now": now,
        }
        if conn.execute(self._q("leader_holds"), params).fetchone() is None:
            raise StaleTokenError(resource=leader.resource, token=leader.token, operation=operation)

    async def maintenance_prune(
        self, *, leader: ResourceLease, kind: PruneKind, before: float, limit: int
    ) -> int:
        """Delete one batch of ``kind`` in one short write transaction; see the seam."""
        kind = PruneKind(kind)

        def run(conn: sqlite3.Connection) -> int:
            with immediate(conn):
                now = self.clock.now()
                self._leader_check(conn, leader, "prune", now)
                if kind in _AUDIT:
                    query = self._q(_AUDIT[kind][0])
                    return conn.execute(query, {"before": before, "limit": limit}).rowcount
                return _prune_jobs(conn, kind, before, limit, now)

        return await self._call(run)

    async def maintenance_prunable(self, *, kind: PruneKind, before: float) -> int:
        """How many rows of ``kind`` are older than ``before``."""
        kind = PruneKind(kind)
        params: dict[str, Any] = {"before": before}
        if kind in _AUDIT:
            query = self._q(_AUDIT[kind][1])
        else:
            query = self._q("prune_jobs_count")
            params["states"] = json.dumps(_STATES[kind])

        def run(conn: sqlite3.Connection) -> int:
            return int(conn.execute(query, params).fetchone()[0])

        return await self._call(run)

    async def schedule_advance(
        self, *, leader: ResourceLease, schedule: str, instant: float, job: NewJob | None
    ) -> bool:
        """Advance the mark and enqueue ``job`` in one transaction, or do nothing."""

        def run(conn: sqlite3.Connection) -> bool:
            with immediate(conn):
                now = self.clock.now()
                self._leader_check(conn, leader, "schedule", now)
                params = {"name": schedule, "instant": instant, "now": now}
                if conn.execute(self._q("schedule_advance"), params).fetchone() is None:
                    return False
                if job is not None:
                    insert_job(conn, Q["enqueue"], _job_row(job, now), job)
                return True

        return await self._call(run)

    async def schedule_marks(self) -> dict[str, float]:
        """Every schedule's mark."""

        def run(conn: sqlite3.Connection) -> dict[str, float]:
            return {r[0]: float(r[1]) for r in conn.execute(self._q("schedule_marks")).fetchall()}

        return await self._call(run)


def _prune_jobs(
    conn: sqlite3.Connection, kind: PruneKind, before: float, limit: int, now: float
) -> int:
    """One batch of finished jobs, with their attempts and released unique keys."""
    picked = conn.execute(
        Q["prune_jobs_pick"],
        {"states": json.dumps(_STATES[kind]), "before": before, "limit": limit},
    ).fetchall()
    if not picked:
        return 0
    ids = json.dumps([r[0] for r in picked])
    keys = json.dumps([r[1] for r in picked if r[1] is not None])
    deleted = conn.execute(Q["prune_jobs"], {"ids": ids}).rowcount
    conn.execute(Q["prune_attempts"], {"ids": ids})
    conn.execute(Q["prune_unique_keys"], {"ids": ids, "keys": keys, "now": now})
    return deleted


def _job_row(job: NewJob, now: float) -> dict[str, Any]:
    run_at = job.run_at if job.run_at is not None else now + (job.delay or 0.0)
    return {
        "queue": job.queue,
        "task": job.task,
        "args": job.args,
        "idempotency_key": job.idempotency_key,
        "priority": job.priority,
        "run_at": run_at,
        "max_attempts": job.max_attempts,
        "max_lease_expiries": job.max_lease_expiries,
        "state": "scheduled" if run_at > now else "queued",
        "now": now,
        "timeout": job.timeout,
    }
