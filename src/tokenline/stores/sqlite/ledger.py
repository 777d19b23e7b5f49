"""The SQLite store's ledger: unique keys, effects, fences, resource-lease renewal and
the duplicate audit (queries in ``ledger.sql``).

Why a stale attempt cannot write: every ledger write runs in one ``BEGIN IMMEDIATE``
transaction whose first statement is the job's token check (``fence_check``). The write
lock is held from that check to the commit, by every process on the file, so no claim,
rescue or other writer can come between the check and the write it guards.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..._jobs import Lease, NewJob, Unique
from ..._records import (
    Duplicate,
    DuplicateKind,
    EffectBegin,
    EffectRecord,
    EffectStatus,
    Fence,
    Start,
    by_attempt,
)
from .._repairs import RERUN, reruns
from .._rows import duplicate_from_row, effect_from_row
from .._sql import load_queries
from ..base import ResourceLease, possible_job_id
from ._connection import immediate

if TYPE_CHECKING:
    from ..._clock import Clock

__all__ = ["LQ", "SQLiteLedger", "insert_job", "stale_lease"]

LQ = load_queries(__name__.rpartition(".")[0], "ledger.sql")
CQ = load_queries(__name__.rpartition(".")[0], "coord.sql")
T = TypeVar("T")


def insert_job(conn: sqlite3.Connection, enqueue_sql: str, row: dict[str, Any], new: NewJob) -> int:
    """Insert one job (inside the caller's write transaction) and return its id; for a
    unique job whose key is held, insert nothing and return the holder's id."""
    if new.unique is None:
        return int(conn.execute(enqueue_sql, row).lastrowid or 0)
    key = new.idempotency_key
    claim = {
        "key": key,
        "unique_for": new.unique_for,
        "while_active": int(new.unique is Unique.ACTIVE),
        "now": row["now"],
    }
    if not conn.execute(LQ["unique_claim"], claim).fetchall():
        (holder,) = conn.execute(LQ["unique_holder"], {"key": key}).fetchone()
        return int(holder)
    job_id = int(conn.execute(enqueue_sql, row).lastrowid or 0)
    conn.execute(LQ["unique_fill"], {"key": key, "job_id": job_id})
    return job_id


def stale_lease(lease: ResourceLease, now: float) -> Duplicate:
    """A refused renewal of a resource lease someone else holds now."""
    return Duplicate(
        lease.resource,
        DuplicateKind.STALE,
        "resource_lease_renew",
        None,
        lease.token,
        lease.owner,
        now,
    )


def _lease_params(lease: Lease, now: float) -> dict[str, Any]:
    return {"job_id": lease.job_id, "token": lease.token, "owner": lease.owner, "now": now}


class SQLiteLedger:
    """Mixin of :class:`~tokenline.stores.sqlite.SQLiteStore` holding its ledger."""

    if TYPE_CHECKING:
        clock: Clock

        async def _call(
            self, fn: Callable[[sqlite3.Connection], T], *, here: bool = False
        ) -> T: ...

        async def _coord_call(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        def _later(self, fn: Callable[[sqlite3.Connection], object]) -> None: ...

        async def _flush(self) -> None: ...

        def _q(self, name: str) -> str: ...

    # -- building blocks, run inside a write transaction ----------------------------------
    def job_fenced(self, conn: sqlite3.Connection, lease: Lease, now: float) -> bool:
        """Whether ``lease`` still holds its job (and, in BEGIN IMMEDIATE, keeps it so)."""
        return conn.execute(self._q("fence_check"), _lease_params(lease, now)).rowcount == 1

    @staticmethod
    def record_duplicate(conn: sqlite3.Connection, dup: Duplicate) -> None:
        """Write one duplicate row for the audit."""
        conn.execute(
            LQ["duplicate_insert"],
            {
                "key": dup.key,
                "kind": dup.kind.value,
                "operation": dup.operation,
                "job_id": dup.job_id,
                "token": dup.token,
                "owner": dup.owner,
                "now": dup.at,
            },
        )

    def fences_in(
        self, conn: sqlite3.Connection, lease: Lease, fences: Sequence[Fence], now: float
    ) -> Fence | None:
        """Advance each fence; return the first one refused (the caller rolls back)."""
        for fence in fences:
            if fence.resource is not None:
                held = {
                    "resource": fence.resource,
                    "owner": fence.owner,
                    "token": fence.token,
                    "now": now,
                }
                if conn.execute(CQ["resource_lease_held"], held).fetchone() is None:
                    return fence
            params = {
                "key": fence.key,
                "issuer": fence.issuer(lease.job_id),
                "token": fence.token,
                "job_id": lease.job_id,
                "owner": lease.owner,
                "now": now,
            }
            if not conn.execute(LQ["fence_advance"], params).fetchall():
                return fence
        return None

    # -- effects --------------------------------------------------------------------------
    async def effect_begin(self, *, lease: Lease, key: str) -> EffectBegin:
        """Take ``key`` for this attempt if allowed; see :meth:`Store.effect_begin`."""

        def run(conn: sqlite3.Connection) -> EffectBegin:
            with immediate(conn):
                now = self.clock.now()
                if not self.job_fenced(conn, lease, now):
                    self.record_duplicate(
                        conn, by_attempt(key, DuplicateKind.STALE, "effect_begin", lease, now)
                    )
                    return EffectBegin(Start.STALE, None)
                params = {"key": key, **_lease_params(lease, now)}
                # Read first: the take overwrites how the key's last run ended.
                prior = conn.execute(LQ["effect_get"], {"key": key}).fetchone()
                taken = conn.execute(LQ["effect_take"], params).fetchall()
                if taken:
                    if prior is not None and reruns(prior["status"], prior["error"]):
                        self.record_duplicate(
                            conn, by_attempt(key, DuplicateKind.REPEAT, RERUN, lease, now)
                        )
                    return EffectBegin(Start.RUN, effect_from_row(taken[0]))
                cur = effect_from_row(prior)
                if cur.status is EffectStatus.COMPLETED:
                    self.record_duplicate(
                        conn, by_attempt(key, DuplicateKind.REPEAT, "effect", lease, now)
                    )
                    return EffectBegin(Start.DONE, cur)
                if cur.job_id == lease.job_id and cur.token > lease.token:
                    self.record_duplicate(
                        conn, by_attempt(key, DuplicateKind.STALE, "effect_begin", lease, now)
                    )
                    return EffectBegin(Start.STALE, cur)
                return EffectBegin(Start.BUSY, cur)

        # One short transaction: it may run on the event loop's thread (see _on_main).
        return await self._call(run, here=True)

    async def effect_finish(
        self, *, lease: Lease, key: str, result: str | None = None, error: str | None = None
    ) -> bool:
        """Record the effect's outcome if the key is still pending under this token."""
        done = error is None

        def run(conn: sqlite3.Connection) -> bool:
            with immediate(conn):
                now = self.clock.now()
                params = {
                    "key": key,
                    "status": (EffectStatus.COMPLETED if done else EffectStatus.FAILED).value,
                    "result": result if done else None,
                    "error": error,
                    **_lease_params(lease, now),
                }
                if conn.execute(LQ["effect_finish"], params).rowcount == 1:
                    return True
                operation = "effect_complete" if done else "effect_fail"
                self.record_duplicate(
                    conn, by_attempt(key, DuplicateKind.STALE, operation, lease, now)
                )
                return False

        # One short transaction: it may run on the event loop's thread (see _on_main).
        return await self._call(run, here=True)

    async def effects_list(
        self, *, job_id: int | None = None, key: str | None = None, limit: int = 100
    ) -> list[EffectRecord]:
        """Effect records, newest first."""
        if job_id is not None and not possible_job_id(job_id):
            return []  # no job has that id
        params = {"job_id": job_id, "key": key, "limit": limit}
        rows = await self._call(lambda c: c.execute(LQ["effects_list"], params).fetchall())
        return [effect_from_row(r) for r in rows]

    # -- fences ---------------------------------------------------------------------------
    async def fence_write(self, *, lease: Lease, fence: Fence) -> bool:
        """Advance one fence after checking the job's token, in one transaction."""

        def run(conn: sqlite3.Connection) -> bool:
            refused = False
            with immediate(conn):
                now = self.clock.now()
                refused = (
                    not self.job_fenced(conn, lease, now)
                    or self.fences_in(conn, lease, [fence], now) is not None
                )
                if not refused:
                    return True
            # The refusal outlives the rolled-back attempt: record it on its own.
            with immediate(conn):
                self.record_duplicate(
                    conn, by_attempt(fence.key, DuplicateKind.STALE, "fence", lease, now)
                )
            return False

        return await self._call(run)

    # -- resource leases and the audit ----------------------------------------------------
    async def resource_lease_renew(
        self, *, lease: ResourceLease, ttl: float
    ) -> ResourceLease | None:
        """Extend the named lease if ``(owner, token)`` still holds it unexpired (on the
        coordination file: never behind a main-file transaction)."""
        params: dict[str, Any] = {
            "resource": lease.resource,
            "owner": lease.owner,
            "token": lease.token,
            "ttl": ttl,
        }

        def run(coord: sqlite3.Connection) -> tuple[ResourceLease | None, bool, float]:
            with immediate(coord):
                now = self.clock.now()
                row = coord.execute(CQ["resource_lease_extend"], {**params, "now": now})
                got = row.fetchone()
                if got is not None:
                    return ResourceLease(*tuple(got)), False, now
                current = coord.execute(CQ["resource_lease_get"], params).fetchone()
            return None, current is not None and current["token"] != lease.token, now

        renewed, stale, now = await self._coord_call(run)
        if stale:
            dup = stale_lease(lease, now)
            self._later(lambda conn: self._record_duplicate_tx(conn, dup))
        return renewed

    def _record_duplicate_tx(self, conn: sqlite3.Connection, dup: Duplicate) -> None:
        with immediate(conn):
            self.record_duplicate(conn, dup)

    async def duplicates_list(
        self, *, since: float | None = None, limit: int = 10_000
    ) -> list[Duplicate]:
        """Ledger duplicates and refused job commits, newest first."""
        await self._flush()
        params = {"since": since, "limit": limit}
        rows = await self._call(lambda c: c.execute(LQ["duplicates_list"], params).fetchall())
        return [duplicate_from_row(r) for r in rows]
