"""The Redis store's side of the reconciler: the reads that find drift in what Redis
holds, and the repairs, one script fenced by the leader's term.

Redis is not a ledger, so it cannot tell alone whether a job's work committed: the
split store (``stores/split/maintenance.py``) asks its ledger about the jobs this side
finds unfinished, and judges the rest here. Every repair runs in ``reconcile_apply.lua``,
which checks the maintenance lease first (owner, token with its epoch, unexpired by
Redis's clock) and then applies each repair only while what it repairs is as it was
seen: Redis runs the script atomically, so nothing falls between check and write.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._errors import StoreError
from ..._jobs import Lease, NewJob
from .._repairs import ACKNOWLEDGED, ACKNOWLEDGED_ERROR, LOST, LOST_ERROR
from ..base import Drift, Inconsistency, ResourceLease, leader_refused
from ._errors import map_redis_errors
from ._values import fmt as _f
from ._values import job_args
from ._values import pairs as _pairs
from ._values import text as _s

if TYPE_CHECKING:
    from redis import asyncio as aioredis

    from ..._jobs import WorkerRecord

__all__ = ["RedisMaintenance", "ScanBatch"]

#: Jobs read per ``reconcile_scan.lua`` call: a pass reads every job Redis holds, a
#: batch at a time, so that no call holds Redis up for long.
SCAN_BATCH = 500
#: The script's error when the caller no longer holds the maintenance lease.
_LEADER_ERROR = "TLLEADER"
#: The owner of a lease a job attempt took through ctx.lease (worker/resources.py):
#: '<worker id>/job<id>/t<token>'. The id may itself hold '/': only the last two parts
#: are the attempt's, so the greedy group is exactly the worker's id (as in
#: ``reconcile_apply.lua``, which checks it again).
_ATTEMPT_OWNER = re.compile(r"(.*)/job[0-9]+/t[0-9]+", re.DOTALL)
_ACTIONS = {
    Drift.JOB_UNACKNOWLEDGED: "ack",
    Drift.LEASE_ORPHANED: "lease",
    Drift.ATTEMPT_OPEN: "attempt",
}


@dataclass(slots=True)
class ScanBatch:
    """What one batch of the scan found: jobs that ran and are unfinished without a
    live lease (``JOB_UNACKNOWLEDGED`` candidates, until a ledger says their work
    committed) and attempts left open."""

    unfinished: list[Inconsistency] = field(default_factory=list)
    open_attempts: list[Inconsistency] = field(default_factory=list)


class RedisMaintenance:
    """Mixin of :class:`~tokenline.stores.redis.RedisStore`: the reconciler's reads and
    its fenced repairs."""

    if TYPE_CHECKING:
        prefix: str
        where: str

        def _redis(self) -> aioredis.Redis: ...

        def _now(self) -> str: ...

        def _epoch_arg(self) -> str: ...

        async def _run(self, name: str, args: Sequence[Any]) -> Any: ...

        async def _cmd(self, *args: Any) -> Any: ...

        async def workers_list(self) -> list[WorkerRecord]: ...

        async def resource_leases_list(self) -> list[ResourceLease]: ...

        async def store_time(self) -> float: ...

        async def job_lease_held(self, *, lease: Lease) -> bool: ...

    async def reconcile_batches(self, *, batch: int = SCAN_BATCH) -> AsyncIterator[ScanBatch]:
        """Every job Redis holds, read in batches of ``batch`` (by id), each batch's
        findings yielded as it is read (see ``reconcile_scan.lua``)."""
        cursor = "0"
        while cursor:
            out = await self._run("reconcile_scan", [self._now(), self._epoch_arg(), cursor, batch])
            cursor = _s(out[1])
            found = ScanBatch()
            for i in range(2, len(out), 4):
                kind, jid, token, what = (_s(v) for v in out[i : i + 4])
                if kind == "unfinished":
                    item = Inconsistency(Drift.JOB_UNACKNOWLEDGED, int(jid), int(token), state=what)
                    found.unfinished.append(item)
                else:
                    item = Inconsistency(Drift.ATTEMPT_OPEN, int(jid), int(token), owner=what)
                    found.open_attempts.append(item)
            yield found

    async def orphaned_leases(self, *, limit: int) -> list[Inconsistency]:
        """Named leases held, unexpired, by a worker whose membership is over (stopped,
        or expired by Redis's clock): under its own id, or by one of its job attempts
        (``ctx.lease``). A holder that is not a worker (a maintenance process, a user's
        own) is never judged. Read in two steps: the repair checks both again."""
        now = await self.store_time()
        workers = {w.id: w for w in await self.workers_list()}
        found = []
        for lease in await self.resource_leases_list():
            worker = workers.get(lease.owner) or workers.get(_attempt_worker(lease.owner) or "")
            if lease.expires_at <= now or worker is None:
                continue
            if worker.state == "stopped" or worker.expires_at <= now:
                item = Inconsistency(
                    Drift.LEASE_ORPHANED, None, lease.token, lease.resource, lease.owner
                )
                found.append(item)
        return found[:limit]

    async def jobs_existing(self, *, job_ids: Sequence[int]) -> set[int]:
        """The jobs among ``job_ids`` that Redis holds (in any state)."""
        client = self._redis()
        with map_redis_errors(self.where, "EXISTS"):
            pipe = client.pipeline(transaction=False)
            for jid in job_ids:
                pipe.execute_command("EXISTS", f"{self.prefix}job:{jid}")
            replies = await pipe.execute()
        return {jid for jid, n in zip(job_ids, replies, strict=True) if int(n)}

    async def job_leases_held(self, *, leases: Sequence[Lease]) -> list[bool]:
        """:meth:`job_lease_held` of each of ``leases``, in order."""
        return [await self.job_lease_held(lease=lease) for lease in leases]

    async def reconcile_apply(
        self, *, leader: ResourceLease, found: Sequence[Inconsistency]
    ) -> list[bool]:
        """Apply the repairs of ``found`` that Redis holds (unacknowledged jobs,
        orphaned leases, open attempts) in one script fenced by ``leader``; whether
        each was applied. :class:`StaleTokenError`, nothing changed, when ``leader`` no
        longer holds the maintenance lease."""
        args: list[Any] = [self._now(), self._epoch_arg()]
        args += [leader.resource, leader.owner, leader.token]
        args += [ACKNOWLEDGED, ACKNOWLEDGED_ERROR, LOST, LOST_ERROR]
        for item in found:
            what = item.job_id if item.kind is not Drift.LEASE_ORPHANED else item.key
            seen = item.state if item.kind is Drift.JOB_UNACKNOWLEDGED else item.owner
            args += [_ACTIONS[item.kind], what, item.token, seen or ""]
        try:
            done = await self._run("reconcile_apply", args)
        except StoreError as exc:
            if _LEADER_ERROR not in str(exc):
                raise
            raise leader_refused(leader, "reconcile") from None
        return [bool(int(x)) for x in done]

    # -- periodic jobs --------------------------------------------------------------------
    async def schedule_advance(
        self, *, leader: ResourceLease, schedule: str, instant: float, job: NewJob | None
    ) -> bool:
        """Move ``schedule``'s mark to ``instant`` and enqueue ``job`` in one script
        (``schedule.lua``), only if the mark is below ``instant`` and ``leader`` still
        holds the maintenance lease (else :class:`StaleTokenError`, nothing written).

        Redis can lose its last writes (a failover to a replica that missed them, a
        restart without persistence). A lost mark goes back with the jobs enqueued
        with it, so the next leader enqueues those instants again: a periodic job may
        then run twice for one instant, once before and once after the failover. What
        keeps its business effect once is the ledger: the job's idempotency key
        (``periodic:<name>:<instant>``) keys its effect, and a completed effect is not
        run again (``ctx.effect``, ``ctx.transaction()`` with the key as a fence).
        """
        args: list[Any] = [self._now(), self._epoch_arg()]
        args += [leader.resource, leader.owner, leader.token, schedule, _f(instant)]
        if job is None:
            args.append(0)
        else:
            args += [1, *job_args(job)]
        try:
            return bool(int(await self._run("schedule", args)))
        except StoreError as exc:
            if _LEADER_ERROR not in str(exc):
                raise
            raise leader_refused(leader, "schedule") from None

    async def schedule_marks(self) -> dict[str, float]:
        """Every schedule's high-water mark, from the ``sched`` hash."""
        marks = _pairs(await self._cmd("HGETALL", self.prefix + "sched"))
        return {name: float(mark) for name, mark in sorted(marks.items())}


def _attempt_worker(owner: str) -> str | None:
    """The id of the worker whose job attempt owns a lease as ``owner``, or ``None``
    when ``owner`` is not shaped as a job attempt's."""
    found = _ATTEMPT_OWNER.fullmatch(owner)
    return None if found is None else found.group(1)
