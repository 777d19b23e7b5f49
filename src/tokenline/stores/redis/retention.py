"""The Redis store's retention: pruning batches, each one script fenced by the leader.

What Redis holds of each :class:`~tokenline.stores.base.PruneKind`:

* ``finished`` and ``dead``: jobs, found through an index of their own (the zsets
  ``ended:finished`` and ``ended:dead``, scored by ``finished_at``), kept by the
  scripts' ``set_state`` wherever a job enters or leaves a final state: a finish, a
  cancel, a rescue that dead-letters, the reconciler's acknowledgement, a retry of a
  dead job. A batch reads only the index, never every job; ``prune.lua`` deletes each
  job with its attempts, state index entries, count and released unique key.
* ``stale_commits``: the ``stale`` list of refused writes (and ``stale_n`` with it).
* ``duplicates``: the ``rl_stale`` list of refused renewals of named leases, which the
  split store reports as duplicates.

Jobs that ended before the index existed (a store written by an earlier release) are
put into it by ``prune_fill.lua``, in batches, before the first prune of a store's
lifetime; until that has run, :meth:`RedisRetention.maintenance_prunable` (a dry run)
counts only the jobs indexed so far. A process of an earlier release still running
during an upgrade finishes jobs without indexing them: those are never pruned.

Every write checks the maintenance lease first, in the same script (``check_leader``,
by Redis's clock); a deposed leader deletes nothing (:class:`StaleTokenError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._errors import StoreError
from ..base import PruneKind, ResourceLease, leader_refused
from ._errors import map_redis_errors
from ._values import fmt as _f

__all__ = ["RedisRetention"]

#: The script's error when the caller no longer holds the maintenance lease.
_LEADER_ERROR = "TLLEADER"
#: The index (``ended:<kind>``) of each job kind.
_JOB_KINDS = {PruneKind.FINISHED: "finished", PruneKind.DEAD: "dead"}
#: The list of each audit kind.
_AUDIT_LISTS = {PruneKind.STALE_COMMITS: "stale", PruneKind.DUPLICATES: "rl_stale"}


class RedisRetention:
    """Mixin of :class:`~tokenline.stores.redis.RedisStore`: the pruner's batches, and
    the notes of pruned jobs a ledger has yet to hear of (split topology)."""

    if TYPE_CHECKING:
        prefix: str
        where: str

        def _redis(self) -> Any: ...

        def _now(self) -> str: ...

        def _epoch_arg(self) -> str: ...

        async def _run(self, name: str, args: Sequence[Any]) -> Any: ...

        async def _cmd(self, *args: Any) -> Any: ...

    #: Set once ``prune_fill.lua`` has indexed the jobs that ended before the index.
    _index_filled = False

    async def maintenance_prune(
        self, *, leader: ResourceLease, kind: PruneKind, before: float, limit: int
    ) -> int:
        """Delete up to ``limit`` of the oldest entries of ``kind`` in one fenced
        script; see the seam and the module docstring."""
        kind = PruneKind(kind)
        if kind in _AUDIT_LISTS:
            if limit < 1:
                return 0
            args: list[Any] = [self._now(), self._epoch_arg(), "prune"]
            args += [leader.resource, leader.owner, leader.token]
            args += [_AUDIT_LISTS[kind], _f(before), limit]
            return int(await self._fenced("prune_audit", args, leader))
        return len(await self.jobs_prune(leader=leader, kind=kind, before=before, limit=limit))

    async def jobs_prune(
        self,
        *,
        leader: ResourceLease,
        kind: PruneKind,
        before: float,
        limit: int,
        note: bool = False,
    ) -> list[int]:
        """One batch of ``kind`` (``finished`` or ``dead``): the ids of the jobs
        deleted. With ``note``, each id is also kept in ``pruned`` until
        :meth:`pruned_forget`: the split store's record of what its ledger must hear."""
        kind = PruneKind(kind)
        if kind not in _JOB_KINDS:
            raise ValueError(f"jobs_prune prunes jobs (finished, dead), not {kind.value}")
        name = _JOB_KINDS[kind]
        if limit < 1:
            return []
        await self._fill_index(leader, limit)
        args: list[Any] = [self._now(), self._epoch_arg()]
        args += [leader.resource, leader.owner, leader.token]
        args += [name, _f(before), limit, 1 if note else 0]
        return [int(i) for i in await self._fenced("prune", args, leader)]

    async def maintenance_prunable(self, *, kind: PruneKind, before: float) -> int:
        """How many entries of ``kind`` are older than ``before`` (read only)."""
        kind = PruneKind(kind)
        if kind in _AUDIT_LISTS:
            args = [self._now(), self._epoch_arg(), "count", "", "", "", _AUDIT_LISTS[kind]]
            return int(await self._run("prune_audit", [*args, _f(before), 0]))
        index = f"{self.prefix}ended:{_JOB_KINDS[kind]}"
        return int(await self._cmd("ZCOUNT", index, "-inf", f"({_f(before)}"))

    async def pruned_noted(self, *, limit: int) -> list[int]:
        """Up to ``limit`` ids noted by :meth:`jobs_prune` and not yet forgotten."""
        ids = await self._cmd("ZRANGE", self.prefix + "pruned", 0, limit - 1)
        return [int(i) for i in ids]

    async def pruned_forget(self, *, job_ids: Sequence[int]) -> None:
        """Drop the notes of ``job_ids`` (their ledger has heard of them)."""
        if job_ids:
            await self._cmd("ZREM", self.prefix + "pruned", *job_ids)

    async def jobs_pruned(self, *, job_ids: Sequence[int]) -> set[int]:
        """The jobs among ``job_ids`` pruned with a note not yet forgotten."""
        client = self._redis()
        with map_redis_errors(self.where, "ZSCORE"):
            pipe = client.pipeline(transaction=False)
            for jid in job_ids:
                pipe.execute_command("ZSCORE", self.prefix + "pruned", jid)
            replies = await pipe.execute()
        return {jid for jid, score in zip(job_ids, replies, strict=True) if score is not None}

    async def _fill_index(self, leader: ResourceLease, batch: int) -> None:
        """Index the jobs that ended before the index existed, a batch per script,
        once per store object (the script remembers, in Redis, that it is done)."""
        while not self._index_filled:
            args = [self._now(), self._epoch_arg(), leader.resource, leader.owner, leader.token]
            self._index_filled = bool(int(await self._fenced("prune_fill", [*args, batch], leader)))

    async def _fenced(self, name: str, args: Sequence[Any], leader: ResourceLease) -> Any:
        """Run a script fenced by ``leader``: its TLLEADER is :class:`StaleTokenError`."""
        try:
            return await self._run(name, args)
        except StoreError as exc:
            if _LEADER_ERROR not in str(exc):
                raise
            raise leader_refused(leader, "prune") from None
