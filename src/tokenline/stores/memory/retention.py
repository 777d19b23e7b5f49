"""The in-memory store's retention and schedule writes: pruning batches and periodic marks.

Every method holds the store's lock for its whole body, as a transaction would: the
check of the leader's lease and the write it guards can never be separated.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..._errors import StaleTokenError
from ..._jobs import Attempt, Job, JobState, NewJob, StaleCommit
from ..._records import Duplicate
from ..base import PruneKind, ResourceLease

if TYPE_CHECKING:
    from ..._clock import Clock

__all__ = ["MemoryRetention"]

_PRUNED = {
    PruneKind.FINISHED: (JobState.SUCCEEDED, JobState.CANCELLED),
    PruneKind.DEAD: (JobState.DEAD,),
}


class MemoryRetention:
    """Mixin of :class:`~tokenline.stores.memory.MemoryStore`: the leader's writes."""

    if TYPE_CHECKING:
        clock: Clock
        _lock: threading.Lock
        _jobs: dict[int, Job]
        _attempts: dict[int, list[Attempt]]
        _leases: dict[str, ResourceLease]
        _stale: list[StaleCommit]
        _duplicates: list[Duplicate]
        _marks: dict[str, float]

        def _insert(self, new: NewJob, now: float) -> int: ...

        def _unique_forget(self, job_ids: set[int], now: float) -> None: ...

    def _check_leader(self, leader: ResourceLease, operation: str, now: float) -> None:
        """Raise unless ``leader`` holds its lease now (called under the lock)."""
        cur = self._leases.get(leader.resource)
        if (
            cur is None
            or cur.owner != leader.owner
            or cur.token != leader.token
            or cur.expires_at <= now
        ):
            raise StaleTokenError(resource=leader.resource, token=leader.token, operation=operation)

    def _prunable(self, kind: PruneKind, before: float) -> list[Any]:
        """What ``kind`` holds older than ``before``, oldest first (under the lock)."""
        if kind is PruneKind.STALE_COMMITS:
            return [s for s in self._stale if s.at < before]
        if kind is PruneKind.DUPLICATES:
            return [d for d in self._duplicates if d.at < before]
        states = _PRUNED[kind]
        old = [
            j
            for j in self._jobs.values()
            if j.state in states and j.finished_at is not None and j.finished_at < before
        ]
        return sorted(old, key=lambda j: (j.finished_at, j.id))

    async def maintenance_prune(
        self, *, leader: ResourceLease, kind: PruneKind, before: float, limit: int
    ) -> int:
        """Delete up to ``limit`` of the oldest rows of ``kind``; see the seam."""
        with self._lock:
            now = self.clock.now()
            self._check_leader(leader, "prune", now)
            victims = self._prunable(kind, before)[:limit]
            if kind is PruneKind.STALE_COMMITS:
                gone = {id(v) for v in victims}
                self._stale = [s for s in self._stale if id(s) not in gone]
            elif kind is PruneKind.DUPLICATES:
                gone = {id(v) for v in victims}
                self._duplicates = [d for d in self._duplicates if id(d) not in gone]
            else:
                ids = {j.id for j in victims}
                for job_id in ids:
                    del self._jobs[job_id]
                    del self._attempts[job_id]
                self._unique_forget(ids, now)
            return len(victims)

    async def maintenance_prunable(self, *, kind: PruneKind, before: float) -> int:
        """How many rows of ``kind`` are older than ``before``."""
        with self._lock:
            return len(self._prunable(kind, before))

    async def schedule_advance(
        self, *, leader: ResourceLease, schedule: str, instant: float, job: NewJob | None
    ) -> bool:
        """Advance the schedule's mark to ``instant`` and enqueue ``job``, or nothing."""
        with self._lock:
            now = self.clock.now()
            self._check_leader(leader, "schedule", now)
            mark = self._marks.get(schedule)
            if mark is not None and instant <= mark:
                return False
            self._marks[schedule] = instant
            if job is not None:
                self._insert(job, now)
            return True

    async def schedule_marks(self) -> dict[str, float]:
        """Every schedule's mark."""
        with self._lock:
            return dict(self._marks)
