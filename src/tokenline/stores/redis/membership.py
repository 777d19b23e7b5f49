"""The Redis store's membership and named leases (the leases role, beside job lease
renewal in ``store.py``): worker membership tokens and named leases with monotonic
tokens, each write one script (``worker.lua``, ``resource.lua``) conditional on the
token it presents, on Redis's clock."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..._jobs import WorkerRecord
from ..._records import Duplicate, DuplicateKind
from ..base import ResourceLease
from ._values import fl as _fl
from ._values import fmt as _f
from ._values import pairs as _pairs
from ._values import text as _s

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["RedisMembership"]


class RedisMembership:
    """Mixin of :class:`~tokenline.stores.redis.RedisStore`: workers and named leases."""

    if TYPE_CHECKING:
        prefix: str

        def _now(self) -> str: ...

        def _epoch_arg(self) -> str: ...

        def _token(self, counter: Any) -> int: ...

        async def _run(self, name: str, args: Sequence[Any]) -> Any: ...

        async def _cmd(self, *args: Any) -> Any: ...

        async def _hashes(self, keys: Sequence[str]) -> list[Any]: ...

    def _worker(self, flat: Any) -> WorkerRecord:
        h = _pairs(flat)
        limit = h.get("concurrency_limit")
        return WorkerRecord(
            id=h["id"],
            host=h["host"],
            pid=int(h["pid"]),
            queues=tuple(json.loads(h["queues"])),
            concurrency=int(h["concurrency"]),
            state=h["state"],
            token=int(h["token"]),
            started_at=float(h["started_at"]),
            heartbeat_at=float(h["heartbeat_at"]),
            expires_at=float(h["expires_at"]),
            in_flight=int(h["in_flight"]),
            clock_skew=_fl(h.get("clock_skew")),
            drain_requested=h.get("drain_requested") == "1",
            concurrency_limit=None if limit is None else int(limit),
        )

    async def _worker_call(self, action: str, worker_id: str, *args: Any) -> WorkerRecord | None:
        out = await self._run("worker", [self._now(), action, worker_id, *args])
        return self._worker(out[1]) if len(out) > 1 else None

    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        """Register ``record`` with a fresh membership token."""
        limit = "" if record.concurrency_limit is None else record.concurrency_limit
        rec = await self._worker_call(
            "register",
            record.id,
            _f(ttl),
            record.host,
            record.pid,
            json.dumps(list(record.queues)),
            record.concurrency,
            record.state,
            limit,
        )
        assert rec is not None  # registration is never refused
        return replace(rec, extra=record.extra)

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
        """Extend the membership lease if it is still held and unexpired."""
        return await self._worker_call(
            "heartbeat",
            worker_id,
            _f(ttl),
            token,
            state,
            in_flight,
            "" if skew is None or not math.isfinite(skew) else _f(skew),
            "" if concurrency_limit is None else concurrency_limit,
        )

    async def worker_deregister(self, *, worker_id: str, token: int) -> None:
        """Mark the worker stopped, if ``token`` still holds its membership."""
        await self._worker_call("deregister", worker_id, token)

    async def workers_list(self) -> list[WorkerRecord]:
        """All workers, newest first."""
        ids = await self._cmd("SMEMBERS", self.prefix + "workers")
        rows = await self._hashes([f"{self.prefix}w:{_s(wid)}" for wid in ids])
        return sorted((self._worker(r) for r in rows if r), key=lambda w: -w.started_at)

    async def worker_drain(self, *, worker_id: str) -> bool:
        """Mark the worker's live membership as asked to drain."""
        return await self._worker_call("drain", worker_id) is not None

    def _resource(self, name: str, flat: Any) -> ResourceLease:
        h = _pairs(flat)
        return ResourceLease(
            name,
            h["owner"],
            self._token(h["token"]),
            float(h["expires_at"]),
            acquired_at=_fl(h.get("acquired_at")),
        )

    async def _resource_call(self, action: str, name: str, *args: Any) -> ResourceLease | None:
        out = await self._run("resource", [self._now(), action, name, self._epoch_arg(), *args])
        if len(out) < 2:
            return None
        return self._resource(name, out[1])

    async def resource_lease_acquire(
        self, *, resource: str, owner: str, ttl: float
    ) -> ResourceLease | None:
        """Take or renew the named lease."""
        return await self._resource_call("acquire", resource, owner, _f(ttl))

    async def resource_lease_renew(
        self, *, lease: ResourceLease, ttl: float
    ) -> ResourceLease | None:
        """Extend the named lease only while ``(owner, token)`` holds it unexpired."""
        return await self._resource_call("renew", lease.resource, lease.owner, lease.token, _f(ttl))

    async def resource_lease_release(self, *, lease: ResourceLease) -> bool:
        """Release the lease if ``(owner, token)`` still holds it."""
        done = await self._resource_call("release", lease.resource, lease.owner, lease.token)
        return done is not None

    async def resource_lease_held(self, *, lease: ResourceLease) -> bool:
        """Whether ``(owner, token)`` still holds the named lease unexpired (read only)."""
        held = await self._resource_call("held", lease.resource, lease.owner, lease.token)
        return held is not None

    async def resource_renewals_refused(self, *, limit: int = 100) -> list[Duplicate]:
        """Refused renewals of named leases while another token held them, newest
        first, as the duplicates a ledger would record."""
        items = (
            await self._cmd("LRANGE", self.prefix + "rl_stale", 0, limit - 1) if limit > 0 else []
        )
        out = []
        for raw in items:
            r = json.loads(raw)
            out.append(
                Duplicate(
                    r["resource"],
                    DuplicateKind.STALE,
                    "resource_lease_renew",
                    None,
                    int(r["token"]),
                    r["owner"],
                    float(r["at"]),
                )
            )
        return out

    async def resource_leases_list(self) -> list[ResourceLease]:
        """Every named lease, held or not, by resource name."""
        names = sorted(_s(n) for n in await self._cmd("SMEMBERS", self.prefix + "rls"))
        rows = await self._hashes([f"{self.prefix}rl:{name}" for name in names])
        return [self._resource(n, r) for n, r in zip(names, rows, strict=True) if r]
