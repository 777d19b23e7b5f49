"""The reconciler on the split topology: Redis's state judged against the ledger's.

Each check reads one side, asks the other about what it found, and reports what
disagrees (:class:`~tokenline.stores.base.Drift`):

* ``job_unacknowledged``: Redis holds a job that ran queued, scheduled, or running on
  an expired lease, and the ledger records its fenced transaction committed
  (``job_fences.done_token``): acknowledged in Redis. The claim does the same for a job
  it is about to hand out; this check covers the jobs no claim reaches (scheduled far
  ahead, a paused queue, a running job whose lease lapsed, before the rescue).
* ``effect_pending_expired``: an effect the ledger holds pending past the deadline
  whose attempt's lease Redis no longer holds: marked failed in the ledger.
* ``lease_orphaned``: a named lease in Redis held by a worker whose membership in
  Redis is over: its token bumped.
* ``attempt_open``: an attempt in Redis without an outcome whose job moved on.
* ``job_lost_from_broker``: a job the ledger has seen and not completed that Redis no
  longer holds at all (a failover or a restart lost it). Nothing can repair it, the
  payload went with Redis: it is flagged in the ledger once, reported with the reason,
  and the attempt that held it may write nothing more there. A job retention pruned is
  not lost: its fence is settled (``pruned_at``) or, until it is, the job is noted in
  Redis as pruned (``retention.py``); the check leaves both.

Fencing. The repairs on Redis run in one script that first checks the maintenance
lease (``reconcile_apply.lua``). The ledger's repairs run in one PostgreSQL
transaction, after the same check on Redis (an early one, as for every ledger write of
this topology), whose first statement advances the maintenance lease's own fence in
the ledger to the leader's term (``leader_fence``): a lower term is refused there even
if Redis lost the lease. Each side is atomic on its own; a term that ends between the
two leaves the second side's repairs undone, and the next leader finds them again.

Cost. A pass reads every job Redis holds, a batch per script call (see
``reconcile_scan.lua``), and every fence row of a job the ledger has not completed,
flagged or seen pruned (a partial index holds just those); the pruner keeps both
bounded: a pruned dead job's row leaves the second.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._jobs import Lease
from ..base import Drift, Inconsistency, ResourceLease, leader_refused

if TYPE_CHECKING:
    from ..redis import RedisStore
    from .ledger import SplitLedger

__all__ = ["SplitMaintenance"]

#: Fence rows read per batch of the lost-job check.
FENCE_BATCH = 500
#: The kinds repaired in Redis; the others are the ledger's.
_ON_REDIS = frozenset({Drift.JOB_UNACKNOWLEDGED, Drift.LEASE_ORPHANED, Drift.ATTEMPT_OPEN})


class SplitMaintenance:
    """Mixin of :class:`~tokenline.stores.split.SplitStore`: ``reconcile_find`` and
    ``reconcile_repair`` across its two sides (see the module docstring)."""

    if TYPE_CHECKING:
        redis: RedisStore
        ledger: SplitLedger

    async def reconcile_find(
        self, *, pending_deadline: float, limit: int = 1000
    ) -> list[Inconsistency]:
        """Every disagreement of each kind, at most ``limit`` of each: read on one
        side, checked on the other (reads only)."""
        unacked, open_attempts = await self._find_in_jobs(limit)
        pending = await self._find_pending(pending_deadline, limit)
        orphans = await self.redis.orphaned_leases(limit=limit)
        lost = await self._find_lost(limit)
        return unacked + pending + orphans + open_attempts + lost

    async def _find_in_jobs(self, limit: int) -> tuple[list[Inconsistency], list[Inconsistency]]:
        unacked: list[Inconsistency] = []
        open_attempts: list[Inconsistency] = []
        async for batch in self.redis.reconcile_batches():
            if batch.unfinished and len(unacked) < limit:
                ids = [item.job_id for item in batch.unfinished if item.job_id is not None]
                done = await self.ledger.jobs_done(job_ids=ids)
                unacked += [item for item in batch.unfinished if item.job_id in done]
            open_attempts += batch.open_attempts
            if len(unacked) >= limit and len(open_attempts) >= limit:
                break
        return unacked[:limit], open_attempts[:limit]

    async def _find_pending(self, deadline: float, limit: int) -> list[Inconsistency]:
        pending = await self.ledger.pending_effects(deadline=deadline, limit=limit)
        held = await self.redis.job_leases_held(leases=[_lease_of(item) for item in pending])
        return [item for item, live in zip(pending, held, strict=True) if not live]

    async def _find_lost(self, limit: int) -> list[Inconsistency]:
        lost: list[Inconsistency] = []
        after = 0
        while len(lost) < limit:
            rows = await self.ledger.fences_unsettled(after=after, limit=FENCE_BATCH)
            if not rows:
                break
            ids = [row.job_id for row in rows if row.job_id is not None]
            present = await self.redis.jobs_existing(job_ids=ids)
            # Pruned, its fence not yet settled: retention's, not lost.
            present |= await self.redis.jobs_pruned(job_ids=ids)
            gone = [row for row in rows if row.job_id not in present]
            # Read again: a job pruned and settled since the first read is not lost.
            still = await self.ledger.fences_still_unsettled(
                job_ids=[row.job_id for row in gone if row.job_id is not None]
            )
            lost += [row for row in gone if row.job_id in still]
            after = max(ids)
        return lost[:limit]

    async def reconcile_repair(
        self, *, leader: ResourceLease, found: Sequence[Inconsistency]
    ) -> list[bool]:
        """Redis's repairs in one fenced script, then the ledger's in one fenced
        transaction (see the module docstring); whether each was applied, in order.
        :class:`StaleTokenError` when ``leader`` no longer holds its term."""
        applied = [False] * len(found)
        on_redis = [i for i, item in enumerate(found) if item.kind in _ON_REDIS]
        if on_redis:
            done = await self.redis.reconcile_apply(
                leader=leader, found=[found[i] for i in on_redis]
            )
            for i, ok in zip(on_redis, done, strict=True):
                applied[i] = ok
        on_ledger = [i for i, item in enumerate(found) if item.kind not in _ON_REDIS]
        if on_ledger:
            if not await self.redis.resource_lease_held(lease=leader):
                raise leader_refused(leader, "reconcile")
            # Read again just before the flag: a job Redis holds now is not lost,
            # whatever the scan saw (ids are never reused: see epoch.lua).
            lost = [found[i].job_id or 0 for i in on_ledger if found[i].kind is Drift.JOB_LOST]
            back = await self.redis.jobs_existing(job_ids=lost)
            still = [
                i
                for i in on_ledger
                if not (found[i].kind is Drift.JOB_LOST and found[i].job_id in back)
            ]
            done = await self.ledger.reconcile_ledger(
                leader=leader, found=[found[i] for i in still]
            )
            for i, ok in zip(still, done, strict=True):
                applied[i] = ok
        return applied


def _lease_of(item: Inconsistency) -> Lease:
    assert item.job_id is not None
    assert item.owner is not None
    return Lease(item.job_id, item.owner, item.token, 0.0)
