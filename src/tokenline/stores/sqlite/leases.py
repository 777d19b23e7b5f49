"""The SQLite store's leases role, on the coordination file: job lease renewal, worker
membership, resource leases and the store's clock (see ``store.py`` for why these
live in a file of their own, and why a stale worker still cannot commit)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..._jobs import Lease, WorkerRecord, renewal_was_stale
from .._rows import worker_from_row
from .._sql import load_queries
from ..base import ResourceLease
from ._connection import immediate

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["SQLiteLeases"]

T = TypeVar("T")
_PACKAGE = __name__.rpartition(".")[0]
Q = load_queries(_PACKAGE)
CQ = load_queries(_PACKAGE, "coord.sql")


class SQLiteLeases:
    """Mixin of :class:`~tokenline.stores.sqlite.SQLiteStore` holding its leases role."""

    if TYPE_CHECKING:
        clock: Any

        def _q(self, name: str) -> str: ...

        def _lane(self, lane: Any) -> Any: ...

        async def _coord_call(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _call_both(
            self, fn: Callable[[sqlite3.Connection, sqlite3.Connection], T]
        ) -> T: ...

        def _later(self, fn: Callable[[sqlite3.Connection], object]) -> None: ...

        def _record_stale_tx(
            self, conn: sqlite3.Connection, leases: Sequence[Lease], operation: str, now: float
        ) -> None: ...

        _main: Any

    async def job_leases_renew(
        self, *, owner: str, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | None]:
        """Extend every held lease in one statement on the coordination file."""

        def run(coord: sqlite3.Connection) -> tuple[dict[int, float], list[Lease], float]:
            held = json.dumps([[lease.job_id, lease.token] for lease in leases])
            stale: list[Lease] = []
            with immediate(coord):
                now = self.clock.now()
                rows = coord.execute(
                    self._q("job_leases_renew"),
                    {"leases": held, "owner": owner, "ttl": ttl, "now": now},
                ).fetchall()
                renewed = {r[0]: r[1] for r in rows}
                lost = [lease for lease in leases if lease.job_id not in renewed]
                if lost:
                    current = coord.execute(
                        CQ["job_lease_holders"], {"ids": json.dumps([x.job_id for x in lost])}
                    ).fetchall()
                    holders: dict[int, tuple[int | None, str | None]] = {
                        r[0]: (r[1], r[2]) for r in current
                    }
                    stale = []
                    for x in lost:
                        held_token, held_owner = holders.get(x.job_id, (None, None))
                        if renewal_was_stale(held_token, held_owner, x.token, owner):
                            stale.append(x)
            return renewed, stale, now

        if not leases:
            return []
        renewed, stale, now = await self._coord_call(run)
        if stale:
            self._later(lambda conn: self._record_stale_tx(conn, stale, "renew", now))
        return [
            Lease(lease.job_id, owner, lease.token, renewed[lease.job_id])
            if lease.job_id in renewed
            else None
            for lease in leases
        ]

    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        """Register (or re-register) a worker with a fresh membership token."""
        params = {
            "id": record.id,
            "host": record.host,
            "pid": record.pid,
            "queues": json.dumps(list(record.queues)),
            "concurrency": record.concurrency,
            "state": record.state,
            "ttl": ttl,
            "concurrency_limit": record.concurrency_limit,
        }

        def run(coord: sqlite3.Connection) -> sqlite3.Row:
            with immediate(coord):
                row: sqlite3.Row = coord.execute(
                    CQ["worker_register"], {**params, "now": self.clock.now()}
                ).fetchone()
            return row

        return worker_from_row(await self._coord_call(run))

    async def worker_heartbeat(
        self,
        *,
        worker_id: str,
        token: int,
        state: str,
        in_flight: int,
        ttl: float,
        skew: float | None = None,
        concurrency_limit: int | None = None,
    ) -> WorkerRecord | None:
        """Extend the membership lease; ``None`` if it was lost."""
        params = {
            "id": worker_id,
            "token": token,
            "state": state,
            "in_flight": in_flight,
            "ttl": ttl,
            "skew": skew,
            "concurrency_limit": concurrency_limit,
        }

        def run(coord: sqlite3.Connection) -> sqlite3.Row | None:
            with immediate(coord):
                row: sqlite3.Row | None = coord.execute(
                    CQ["worker_heartbeat"], {**params, "now": self.clock.now()}
                ).fetchone()
            return row

        row = await self._coord_call(run)
        return None if row is None else worker_from_row(row)

    async def store_time(self) -> float:
        """The store's clock (the machine's, anchored for this boot; see ``_clock.py``)."""
        self._lane(self._main)
        return float(self.clock.now())

    async def worker_deregister(self, *, worker_id: str, token: int) -> None:
        """Mark the worker stopped."""

        def run(coord: sqlite3.Connection) -> None:
            params = {"id": worker_id, "token": token, "now": self.clock.now()}
            coord.execute(CQ["worker_deregister"], params)

        await self._coord_call(run)

    async def workers_list(self) -> list[WorkerRecord]:
        """All workers, newest first."""
        rows = await self._coord_call(lambda c: c.execute(CQ["workers_list"]).fetchall())
        return [worker_from_row(r) for r in rows]

    async def worker_drain(self, *, worker_id: str) -> bool:
        """Mark the worker's live membership as asked to drain."""

        def run(coord: sqlite3.Connection) -> bool:
            params = {"id": worker_id, "now": self.clock.now()}
            return bool(coord.execute(CQ["worker_drain"], params).rowcount)

        return await self._coord_call(run)

    async def resource_lease_acquire(
        self, *, resource: str, owner: str, ttl: float
    ) -> ResourceLease | None:
        """Take, or renew, the named lease.

        Renewing, or finding it held by someone else, touches only the coordination
        file. Taking a free lease issues a token one higher than both the main file's
        record of the highest ever issued and the coordination file's last holder, and
        raises that record: a token never repeats, even if either file lost its write.
        """
        key = {"resource": resource, "owner": owner, "ttl": ttl, "token": None}

        def held(coord: sqlite3.Connection) -> tuple[bool, ResourceLease | None]:
            """(decided, lease): the lease is ours (renewed) or someone else's."""
            with immediate(coord):
                now = self.clock.now()
                row = coord.execute(CQ["resource_lease_extend"], {**key, "now": now}).fetchone()
                if row is not None:
                    return True, ResourceLease(*tuple(row))
                cur = coord.execute(CQ["resource_lease_get"], key).fetchone()
                return cur is not None and cur["expires_at"] > now, None

        decided, lease = await self._coord_call(held)
        if decided:
            return lease

        def take(conn: sqlite3.Connection, coord: sqlite3.Connection) -> ResourceLease | None:
            with immediate(conn):
                now = self.clock.now()
                issued = conn.execute(Q["lease_token_get"], key).fetchone()
                with immediate(coord):
                    cur = coord.execute(CQ["resource_lease_get"], key).fetchone()
                    if cur is not None and cur["expires_at"] > now:
                        if cur["owner"] != owner:
                            return None
                        row = coord.execute(
                            CQ["resource_lease_extend"], {**key, "now": now}
                        ).fetchone()
                        return ResourceLease(*tuple(row))
                    token = 1 + max(issued[0] if issued else 0, cur["token"] if cur else 0)
                    row = coord.execute(
                        CQ["resource_lease_take"], {**key, "token": token, "now": now}
                    ).fetchone()
                conn.execute(Q["lease_token_raise"], {"resource": resource, "token": token})
            return ResourceLease(*tuple(row))

        return await self._call_both(take)

    async def resource_lease_release(self, *, lease: ResourceLease) -> bool:
        """Release the named lease if ``(owner, token)`` still holds it."""

        def run(coord: sqlite3.Connection) -> bool:
            params = {
                "resource": lease.resource,
                "owner": lease.owner,
                "token": lease.token,
                "now": self.clock.now(),
            }
            return bool(coord.execute(CQ["resource_lease_release"], params).rowcount)

        return await self._coord_call(run)

    async def resource_leases_list(self) -> list[ResourceLease]:
        """Every named lease, held or not, by resource name."""
        rows = await self._coord_call(lambda c: c.execute(CQ["resource_leases_list"]).fetchall())
        return [ResourceLease(*tuple(r)) for r in rows]
