"""The PostgreSQL store's ledger (queries in ``ledger.sql``).

Why a stale attempt cannot write: a ledger write that needs the job's token runs in one
transaction that starts with ``fence_check`` (``SELECT … FOR NO KEY UPDATE`` of the job row
with its token). From then until commit no rescue (``SKIP LOCKED``) or finish can change
the job's token, so the check still holds when the ledger row is written. Recording the
outcome of a running effect is fenced by the key's own ``(job, token)`` instead, in one
statement that also records a refusal.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import DictRow, TupleRow, dict_row

from ..._errors import StoreError
from ..._jobs import Lease
from ..._records import (
    Duplicate,
    DuplicateKind,
    EffectBegin,
    EffectStatus,
    Fence,
    Start,
    by_attempt,
)
from .._repairs import ABANDONED, RERUN
from .._rows import duplicate_from_row, effect_from_row
from ..base import ResourceLease, possible_job_id
from ._steps import AsyncDriver, Steps, execute, fetch_one

if TYPE_CHECKING:
    from ..._records import EffectRecord

__all__ = ["PostgresLedger"]

T = TypeVar("T")


def _lease_params(lease: Lease, now: float | None) -> dict[str, Any]:
    return {"job_id": lease.job_id, "token": lease.token, "owner": lease.owner, "now": now}


class PostgresLedger:
    """Mixin of :class:`~tokenline.stores.postgres.PostgresStore` holding its ledger."""

    if TYPE_CHECKING:

        def _q(self, name: str) -> str: ...

        def _now(self) -> float | None: ...

        async def _call(self, fn: Callable[[AsyncConnection[Any]], Awaitable[T]]) -> T: ...

        async def _rows(self, query: str, params: dict[str, Any]) -> list[DictRow]: ...

        async def _tuples(self, query: str, params: dict[str, Any]) -> list[TupleRow]: ...

        async def _fence_check_on(self, conn: AsyncConnection[Any], lease: Lease) -> bool: ...

    # -- building blocks, run inside the caller's transaction -----------------------------
    async def record_duplicate_on(self, conn: AsyncConnection[Any], dup: Duplicate) -> None:
        """Write one duplicate row for the audit (its ``at`` is the store's now)."""
        await AsyncDriver(conn).run(self.record_duplicate_steps(dup))

    def record_duplicate_steps(self, dup: Duplicate) -> Steps[None]:
        """:meth:`record_duplicate_on` as steps, for either kind of connection."""
        params = {
            "key": dup.key,
            "kind": dup.kind.value,
            "operation": dup.operation,
            "job_id": dup.job_id,
            "token": dup.token,
            "owner": dup.owner,
            "now": self._now(),
        }
        yield from execute(self._q("duplicate_insert"), params)

    async def fences_on(
        self, conn: AsyncConnection[Any], lease: Lease, fences: Sequence[Fence]
    ) -> Fence | None:
        """Advance each fence; return the first one refused (the caller rolls back)."""
        return await AsyncDriver(conn).run(self.fences_steps(lease, fences))

    def fences_steps(self, lease: Lease, fences: Sequence[Fence]) -> Steps[Fence | None]:
        """:meth:`fences_on` as steps, for either kind of connection."""
        for fence in fences:
            if fence.resource is not None:
                held = {
                    "resource": fence.resource,
                    "owner": fence.owner,
                    "token": fence.token,
                    "now": self._now(),
                }
                if (yield from fetch_one(self._q("lease_held"), held)) is None:
                    return fence
            params = {
                "key": fence.key,
                "issuer": fence.issuer(lease.job_id),
                "token": fence.token,
                "job_id": lease.job_id,
                "owner": lease.owner,
                "now": self._now(),
            }
            if (yield from fetch_one(self._q("fence_advance"), params)) is None:
                return fence
        return None

    # -- effects --------------------------------------------------------------------------
    async def effect_begin(self, *, lease: Lease, key: str) -> EffectBegin:
        """Take ``key`` for this attempt if allowed; see :meth:`Store.effect_begin`."""

        params = {
            "key": key,
            **_lease_params(lease, self._now()),
            "rerun": RERUN,
            "abandoned": ABANDONED,
        }

        async def run(conn: AsyncConnection[Any]) -> EffectBegin:
            cur = conn.cursor(row_factory=dict_row)
            # The common case in one statement: the token holds and the key is free.
            await cur.execute(self._q("effect_take"), params)
            taken = await cur.fetchone()
            if taken is not None:
                return EffectBegin(Start.RUN, effect_from_row(taken))
            # Otherwise a transaction finds out why, and records it.
            async with conn.transaction():
                stale = by_attempt(key, DuplicateKind.STALE, "effect_begin", lease, 0.0)
                if not await self._fence_check_on(conn, lease):
                    await self.record_duplicate_on(conn, stale)
                    return EffectBegin(Start.STALE, None)
                await cur.execute(self._q("effect_take"), params)
                taken = await cur.fetchone()
                if taken is not None:
                    return EffectBegin(Start.RUN, effect_from_row(taken))
                # The conflicting row is locked by effect_take: this read is its latest.
                await cur.execute(self._q("effect_get"), {"key": key})
                row = await cur.fetchone()
                if row is None:  # the row is locked by us: it cannot have gone
                    raise StoreError(f"effect {key!r} vanished under its lock")
                record: EffectRecord = effect_from_row(row)
                if record.status is EffectStatus.COMPLETED:
                    repeat = by_attempt(key, DuplicateKind.REPEAT, "effect", lease, 0.0)
                    await self.record_duplicate_on(conn, repeat)
                    return EffectBegin(Start.DONE, record)
                if record.job_id == lease.job_id and record.token > lease.token:
                    await self.record_duplicate_on(conn, stale)
                    return EffectBegin(Start.STALE, record)
                return EffectBegin(Start.BUSY, record)

        return await self._call(run)

    async def effect_finish(
        self, *, lease: Lease, key: str, result: str | None = None, error: str | None = None
    ) -> bool:
        """Record the effect's outcome if the key is still pending under this token."""
        done = error is None
        params = {
            "key": key,
            "status": (EffectStatus.COMPLETED if done else EffectStatus.FAILED).value,
            "result": result if done else None,
            "error": error,
            "operation": "effect_complete" if done else "effect_fail",
            **_lease_params(lease, self._now()),
        }
        ((n,),) = await self._tuples(self._q("effect_finish"), params)
        return int(n) == 1

    async def effects_list(
        self, *, job_id: int | None = None, key: str | None = None, limit: int = 100
    ) -> list[EffectRecord]:
        """Effect records, newest first."""
        if job_id is not None and not possible_job_id(job_id):
            return []  # no job has that id
        params = {"job_id": job_id, "key": key, "limit": limit}
        return [effect_from_row(r) for r in await self._rows(self._q("effects_list"), params)]

    # -- fences ---------------------------------------------------------------------------
    async def fence_write(self, *, lease: Lease, fence: Fence) -> bool:
        """Advance one fence after checking the job's token, in one transaction."""

        async def run(conn: AsyncConnection[Any]) -> bool:
            async with conn.transaction():
                if (
                    await self._fence_check_on(conn, lease)
                    and await self.fences_on(conn, lease, [fence]) is None
                ):
                    return True
                # Ends the block with a rollback, not an error.
                raise psycopg.Rollback()
            # The refusal outlives the rolled-back attempt: record it on its own.
            stale = by_attempt(fence.key, DuplicateKind.STALE, "fence", lease, 0.0)
            await self.record_duplicate_on(conn, stale)
            return False

        return await self._call(run)

    # -- resource leases and the audit ----------------------------------------------------
    async def resource_lease_renew(
        self, *, lease: ResourceLease, ttl: float
    ) -> ResourceLease | None:
        """Extend the named lease if ``(owner, token)`` still holds it unexpired."""
        params = {
            "resource": lease.resource,
            "owner": lease.owner,
            "token": lease.token,
            "ttl": ttl,
            "now": self._now(),
        }
        rows = await self._tuples(self._q("resource_lease_renew"), params)
        return ResourceLease(*rows[0]) if rows else None

    async def duplicates_list(
        self, *, since: float | None = None, limit: int = 10_000
    ) -> list[Duplicate]:
        """Ledger duplicates and refused job commits, newest first."""
        rows = await self._rows(self._q("duplicates_list"), {"since": since, "limit": limit})
        return [duplicate_from_row(r) for r in rows]
