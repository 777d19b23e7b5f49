"""Retention on the split topology: Redis pruned as the Redis store prunes, and the
ledger told, so that its lost-job check and the pruner agree.

* ``finished`` and ``dead``: a batch is deleted from Redis by ``prune.lua``, which also
  notes each id in Redis (``pruned``), in the same script. The ledger then settles
  those jobs' fences (``job_fences.pruned_at``), and only then are the notes dropped.
  A settled fence refuses every token of its job and is left by the
  ``job_lost_from_broker`` check; a job pruned but not yet settled (the ledger was
  down, the leader changed between the two writes) is still noted in Redis, which that
  check also reads, and the next batch settles it first. So a pruned job is never
  reported lost, and a job the check reports lost was never pruned.
* ``stale_commits`` and ``duplicates``: Redis's audit lists first (refused finishes and
  renewals, refused lease renewals), then the ledger's tables, within one ``limit``.

Fencing: Redis's writes in the scripts, by the maintenance lease; the ledger's in one
transaction that first advances the lease's own fence in the ledger to the leader's
term, after the same check on Redis (as the reconciler's ledger repairs).

The fence rows are settled, not deleted: the ledger creates a row for a token it has
not seen, so an absent row would let a stale attempt of a pruned job write again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base import PruneKind, ResourceLease, leader_refused

if TYPE_CHECKING:
    from ..redis import RedisStore
    from .ledger import SplitLedger

__all__ = ["SplitRetention"]

_JOB_KINDS = frozenset({PruneKind.FINISHED, PruneKind.DEAD})


class SplitRetention:
    """Mixin of :class:`~tokenline.stores.split.SplitStore`: the pruner's batches
    across its two sides (see the module docstring)."""

    if TYPE_CHECKING:
        redis: RedisStore
        ledger: SplitLedger

    async def maintenance_prune(
        self, *, leader: ResourceLease, kind: PruneKind, before: float, limit: int
    ) -> int:
        """One batch of ``kind``: jobs deleted from Redis with their fences settled in
        the ledger, or audit entries from Redis and then the ledger; how many."""
        kind = PruneKind(kind)
        if kind in _JOB_KINDS:
            await self._settle_noted(leader, limit)
            ids = await self.redis.jobs_prune(
                leader=leader, kind=kind, before=before, limit=limit, note=True
            )
            await self._settle(leader, ids)
            return len(ids)
        n = await self.redis.maintenance_prune(leader=leader, kind=kind, before=before, limit=limit)
        if n < limit:
            await self._leader_on_redis(leader)
            n += await self.ledger.prune_audit(
                leader=leader, kind=kind, before=before, limit=limit - n
            )
        return n

    async def maintenance_prunable(self, *, kind: PruneKind, before: float) -> int:
        """How many entries of ``kind`` a prune would delete: Redis's, and for the
        audit kinds the ledger's too."""
        kind = PruneKind(kind)
        n = await self.redis.maintenance_prunable(kind=kind, before=before)
        if kind not in _JOB_KINDS:
            n += await self.ledger.maintenance_prunable(kind=kind, before=before)
        return n

    async def _settle_noted(self, leader: ResourceLease, limit: int) -> None:
        """Settle the jobs an earlier batch pruned and left noted (its ledger write
        failed or was never made)."""
        while limit > 0:
            ids = await self.redis.pruned_noted(limit=limit)
            await self._settle(leader, ids)
            if len(ids) < limit:
                return

    async def _settle(self, leader: ResourceLease, job_ids: Sequence[int]) -> None:
        """Settle the fences of ``job_ids`` in the ledger, then drop their notes."""
        if not job_ids:
            return
        await self._leader_on_redis(leader)
        await self.ledger.fences_pruned(leader=leader, job_ids=job_ids)
        await self.redis.pruned_forget(job_ids=job_ids)

    async def _leader_on_redis(self, leader: ResourceLease) -> None:
        """The early check of every ledger write: Redis still holds ``leader``."""
        if not await self.redis.resource_lease_held(lease=leader):
            raise leader_refused(leader, "prune")
