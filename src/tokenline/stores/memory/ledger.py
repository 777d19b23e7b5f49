"""The in-memory store's ledger: the reference for what the SQL ledgers do.

Every method holds the store's lock for its whole body, as a transaction would: the
job's token check and the ledger write it guards can never be separated.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._jobs import Job, JobState, Lease, NewJob, Unique
from ..._records import (
    Duplicate,
    DuplicateKind,
    EffectBegin,
    EffectRecord,
    EffectStatus,
    Fence,
    Start,
)
from .._repairs import RERUN, reruns
from ..base import ResourceLease, possible_job_id

if TYPE_CHECKING:
    from ..._clock import Clock
    from ..._jobs import StaleCommit

__all__ = ["MemoryLedger", "may_take"]

_FINISHED = (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)


@dataclasses.dataclass
class _UniqueKey:
    job_id: int
    held_until: float | None
    while_active: bool


def may_take(record: EffectRecord, job_id: int, token: int, owner_live: bool) -> bool:
    """Whether the attempt ``(job_id, token)`` may take an existing effect ``record``.

    Within one job tokens order the attempts: only a newer one takes a pending key over,
    and a failed key may be run again by the same or a newer one. Another job's tokens
    are not comparable: it takes a failed key, or a pending one whose owner lost its lease.
    """
    if record.status is EffectStatus.COMPLETED:
        return False
    if record.job_id == job_id:
        if record.status is EffectStatus.FAILED:
            return record.token <= token
        return record.token < token
    return record.status is EffectStatus.FAILED or not owner_live


class MemoryLedger:
    """Mixin of :class:`~tokenline.stores.memory.MemoryStore` holding its ledger."""

    if TYPE_CHECKING:
        clock: Clock
        _lock: threading.Lock
        _jobs: dict[int, Job]
        _leases: dict[str, ResourceLease]
        _stale: list[StaleCommit]

        def _holds(self, lease: Lease) -> bool: ...

    def _ledger_init(self) -> None:
        self._unique: dict[str, _UniqueKey] = {}
        self._effects: dict[str, EffectRecord] = {}
        # Per (key, issuer): the highest token that wrote, with its job and owner.
        self._fences: dict[tuple[str, str], tuple[int, int | None, str | None]] = {}
        self._duplicates: list[Duplicate] = []

    # -- unique enqueue (called under the lock by jobs_enqueue) ---------------------------
    def _unique_holder(self, new: NewJob, next_id: int, now: float) -> int | None:
        """The id of the job holding ``new``'s key, or ``None`` after ``next_id`` took it."""
        assert new.idempotency_key is not None
        held = self._unique.get(new.idempotency_key)
        if held is not None and not self._released(held, now):
            return held.job_id
        until = None if new.unique_for is None else now + new.unique_for
        self._unique[new.idempotency_key] = _UniqueKey(next_id, until, new.unique is Unique.ACTIVE)
        return None

    def _released(self, held: _UniqueKey, now: float) -> bool:
        if held.held_until is not None and held.held_until <= now:
            return True
        job = self._jobs.get(held.job_id)
        return held.while_active and job is not None and job.state in _FINISHED

    def _unique_forget(self, job_ids: set[int], now: float) -> None:
        """Drop the keys of pruned ``job_ids`` that no longer keep anything out: a key
        held for good (``always``, no ``unique_for``) stays."""
        for key, held in list(self._unique.items()):
            if held.job_id in job_ids and (
                held.while_active or (held.held_until is not None and held.held_until <= now)
            ):
                del self._unique[key]

    # -- effects --------------------------------------------------------------------------
    def _duplicate(
        self, key: str, kind: DuplicateKind, operation: str, lease: Lease, now: float
    ) -> None:
        self._duplicates.append(
            Duplicate(key, kind, operation, lease.job_id, lease.token, lease.owner, now)
        )

    def _owner_live(self, record: EffectRecord, now: float) -> bool:
        job = self._jobs.get(record.job_id)
        return (
            job is not None
            and job.state is JobState.RUNNING
            and job.lease_token == record.token
            and (job.lease_expires_at or 0) > now
        )

    async def effect_begin(self, *, lease: Lease, key: str) -> EffectBegin:
        """Take ``key`` for this attempt if allowed; see :meth:`Store.effect_begin`."""
        with self._lock:
            now = self.clock.now()
            if not self._holds(lease):
                self._duplicate(key, DuplicateKind.STALE, "effect_begin", lease, now)
                return EffectBegin(Start.STALE, self._effects.get(key))
            cur = self._effects.get(key)
            if cur is None or may_take(cur, lease.job_id, lease.token, self._owner_live(cur, now)):
                taken = EffectRecord(
                    key=key,
                    status=EffectStatus.PENDING,
                    result=None,
                    error=None,
                    job_id=lease.job_id,
                    token=lease.token,
                    owner=lease.owner,
                    runs=(cur.runs if cur else 0) + 1,
                    created_at=cur.created_at if cur else now,
                    updated_at=now,
                    completed_at=None,
                )
                self._effects[key] = taken
                if cur is not None and reruns(cur.status.value, cur.error):
                    self._duplicate(key, DuplicateKind.REPEAT, RERUN, lease, now)
                return EffectBegin(Start.RUN, taken)
            if cur.status is EffectStatus.COMPLETED:
                self._duplicate(key, DuplicateKind.REPEAT, "effect", lease, now)
                return EffectBegin(Start.DONE, cur)
            if cur.job_id == lease.job_id and cur.token > lease.token:
                self._duplicate(key, DuplicateKind.STALE, "effect_begin", lease, now)
                return EffectBegin(Start.STALE, cur)
            return EffectBegin(Start.BUSY, cur)

    async def effect_finish(
        self, *, lease: Lease, key: str, result: str | None = None, error: str | None = None
    ) -> bool:
        """Record the effect's outcome if the key is still pending under this token."""
        with self._lock:
            now = self.clock.now()
            cur = self._effects.get(key)
            ok = (
                cur is not None
                and cur.status is EffectStatus.PENDING
                and (cur.job_id, cur.token, cur.owner) == (lease.job_id, lease.token, lease.owner)
            )
            operation = "effect_complete" if error is None else "effect_fail"
            if cur is None or not ok:
                self._duplicate(key, DuplicateKind.STALE, operation, lease, now)
                return False
            done = error is None
            self._effects[key] = dataclasses.replace(
                cur,
                status=EffectStatus.COMPLETED if done else EffectStatus.FAILED,
                result=result if done else None,
                error=error,
                updated_at=now,
                completed_at=now if done else None,
            )
            return True

    async def effects_list(
        self, *, job_id: int | None = None, key: str | None = None, limit: int = 100
    ) -> list[EffectRecord]:
        """Effect records, newest first."""
        if job_id is not None and not possible_job_id(job_id):
            return []  # no job has that id
        with self._lock:
            found = [
                r
                for r in self._effects.values()
                if (job_id is None or r.job_id == job_id) and (key is None or r.key == key)
            ]
            return sorted(found, key=lambda r: -r.updated_at)[:limit]

    # -- fences ---------------------------------------------------------------------------
    def _fence_ok(self, lease: Lease, fence: Fence, now: float) -> bool:
        if fence.resource is not None:
            held = self._leases.get(fence.resource)
            if (
                held is None
                or (held.owner, held.token) != (fence.owner, fence.token)
                or held.expires_at <= now
            ):
                return False
        slot = (fence.key, fence.issuer(lease.job_id))
        token, job_id, owner = self._fences.get(slot, (0, None, None))
        # An equal token passes only from the same holder writing again (see
        # fence_advance in the PostgreSQL ledger's queries).
        return token < fence.token or (
            token == fence.token and (job_id, owner) == (lease.job_id, lease.owner)
        )

    def _fences_apply(self, lease: Lease, fences: Sequence[Fence], now: float) -> Fence | None:
        """Advance every fence, or none: the first refused one, else ``None``."""
        for fence in fences:
            if not self._fence_ok(lease, fence, now):
                self._duplicate(fence.key, DuplicateKind.STALE, "fence", lease, now)
                return fence
        for fence in fences:
            slot = (fence.key, fence.issuer(lease.job_id))
            self._fences[slot] = (fence.token, lease.job_id, lease.owner)
        return None

    async def fence_write(self, *, lease: Lease, fence: Fence) -> bool:
        """Advance one fence after checking the job's token."""
        with self._lock:
            now = self.clock.now()
            if not self._holds(lease):
                self._duplicate(fence.key, DuplicateKind.STALE, "fence", lease, now)
                return False
            return self._fences_apply(lease, [fence], now) is None

    # -- resource leases and the audit ----------------------------------------------------
    async def resource_lease_renew(
        self, *, lease: ResourceLease, ttl: float
    ) -> ResourceLease | None:
        """Extend the named lease if ``(owner, token)`` still holds it unexpired."""
        with self._lock:
            now = self.clock.now()
            cur = self._leases.get(lease.resource)
            if (
                cur is None
                or (cur.owner, cur.token) != (lease.owner, lease.token)
                or cur.expires_at <= now
            ):
                if cur is not None and cur.token != lease.token:
                    self._duplicates.append(
                        Duplicate(
                            lease.resource,
                            DuplicateKind.STALE,
                            "resource_lease_renew",
                            None,
                            lease.token,
                            lease.owner,
                            now,
                        )
                    )
                return None
            renewed = dataclasses.replace(cur, expires_at=now + ttl)
            self._leases[lease.resource] = renewed
            return renewed

    async def duplicates_list(
        self, *, since: float | None = None, limit: int = 10_000
    ) -> list[Duplicate]:
        """Ledger duplicates and refused job commits, newest first."""
        with self._lock:
            found = list(self._duplicates)
            for s in self._stale:
                job = self._jobs.get(s.job_id)
                key = job.idempotency_key if job and job.idempotency_key else f"job:{s.job_id}"
                found.append(
                    Duplicate(
                        key, DuplicateKind.STALE, s.operation, s.job_id, s.token, s.owner, s.at
                    )
                )
            found = [d for d in found if since is None or d.at >= since]
            return sorted(found, key=lambda d: -d.at)[:limit]
