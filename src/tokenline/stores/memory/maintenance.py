"""The in-memory store's maintenance writes: the reference for the SQL stores.

Every method holds the store's lock for its whole body, as a transaction would: the
leader check and the repairs it guards can never be separated.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..._jobs import Attempt, Job, JobState
from ..._records import EffectRecord, EffectStatus
from .._repairs import ABANDONED, ACKNOWLEDGED, ACKNOWLEDGED_ERROR, LOST, LOST_ERROR
from ..base import Drift, Inconsistency, ResourceLease, leader_refused

if TYPE_CHECKING:
    from ..._clock import Clock
    from ..._jobs import WorkerRecord

__all__ = ["MemoryMaintenance"]

_UNACKED_STATES = (JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING)
#: The owner of a lease a job attempt took through ctx.lease (worker/resources.py):
#: '<worker id>/job<id>/t<token>'. The id may itself hold '/': only the last two parts
#: are the attempt's, so the greedy group is exactly the worker's id.
_ATTEMPT_OWNER = re.compile(r"(.*)/job[0-9]+/t[0-9]+", re.DOTALL)


def _attempt_worker(owner: str) -> str | None:
    """The id of the worker whose job attempt owns a lease as ``owner``, or ``None``
    when ``owner`` is not shaped as a job attempt's."""
    found = _ATTEMPT_OWNER.fullmatch(owner)
    return None if found is None else found.group(1)


class MemoryMaintenance:
    """Mixin of :class:`~tokenline.stores.memory.MemoryStore`: leader-fenced writes."""

    if TYPE_CHECKING:
        clock: Clock
        _lock: threading.Lock
        _jobs: dict[int, Job]
        _attempts: dict[int, list[Attempt]]
        _leases: dict[str, ResourceLease]
        _workers: dict[str, WorkerRecord]
        _effects: dict[str, EffectRecord]

        def _close_attempt(
            self, job_id: int, token: int, outcome: str, fin: Any, now: float, reason: str = ...
        ) -> None: ...

        def _move_job(self, job: Job, **changes: Any) -> Job: ...

    def _check_leader(self, leader: ResourceLease | None, operation: str, now: float) -> None:
        """Raise unless ``leader`` holds its lease now (called under the lock)."""
        if leader is None:
            return
        cur = self._leases.get(leader.resource)
        if (
            cur is None
            or cur.owner != leader.owner
            or cur.token != leader.token
            or cur.expires_at <= now
        ):
            raise leader_refused(leader, operation)

    def _lease_live(self, job_id: int, token: int, now: float) -> bool:
        job = self._jobs.get(job_id)
        return (
            job is not None
            and job.state is JobState.RUNNING
            and job.lease_token == token
            and (job.lease_expires_at or 0) > now
        )

    async def reconcile_find(
        self, *, pending_deadline: float, limit: int = 1000
    ) -> list[Inconsistency]:
        """Every disagreement of each kind, read under the lock."""
        with self._lock:
            now = self.clock.now()
            found: list[Inconsistency] = []
            for finder in self._finders().values():
                found.extend(finder(now, pending_deadline)[:limit])
            return found

    def _finders(self) -> dict[Drift, Callable[[float, float], list[Inconsistency]]]:
        return {
            Drift.JOB_UNACKNOWLEDGED: self._find_unacked,
            Drift.EFFECT_PENDING: self._find_pending,
            Drift.LEASE_ORPHANED: self._find_orphans,
            Drift.ATTEMPT_OPEN: self._find_open_attempts,
        }

    def _committed(self, job: Job) -> bool:
        # Only a succeeded attempt proves the handler finished; an effect of the job's
        # own key completing proves that effect ran, not what came after it.
        return any(a.outcome == "succeeded" for a in self._attempts.get(job.id, []))

    def _find_unacked(self, now: float, deadline: float) -> list[Inconsistency]:
        return [
            Inconsistency(Drift.JOB_UNACKNOWLEDGED, job.id, job.lease_token, state=job.state.value)
            for job in sorted(self._jobs.values(), key=lambda j: j.id)
            if job.state in _UNACKED_STATES
            and job.lease_token > 0  # only a job that ran can have committed
            and not self._lease_live(job.id, job.lease_token, now)
            and self._committed(job)
        ]

    def _find_pending(self, now: float, deadline: float) -> list[Inconsistency]:
        return [
            Inconsistency(Drift.EFFECT_PENDING, e.job_id, e.token, key=e.key, owner=e.owner)
            for e in sorted(self._effects.values(), key=lambda e: e.key)
            if e.status is EffectStatus.PENDING
            and e.updated_at <= now - deadline
            and not self._lease_live(e.job_id, e.token, now)
        ]

    def _find_orphans(self, now: float, deadline: float) -> list[Inconsistency]:
        out = []
        for name in sorted(self._leases):
            lease = self._leases[name]
            worker = self._workers.get(lease.owner) or self._workers.get(
                _attempt_worker(lease.owner) or ""
            )
            if lease.expires_at > now and worker is not None and _gone(worker, now):
                out.append(
                    Inconsistency(Drift.LEASE_ORPHANED, None, lease.token, name, lease.owner)
                )
        return out

    def _find_open_attempts(self, now: float, deadline: float) -> list[Inconsistency]:
        out = []
        for job_id in sorted(self._attempts):
            job = self._jobs[job_id]
            for att in self._attempts[job_id]:
                if att.finished_at is None and not (
                    job.state is JobState.RUNNING and job.lease_token == att.token
                ):
                    out.append(
                        Inconsistency(Drift.ATTEMPT_OPEN, job_id, att.token, owner=att.owner)
                    )
        return out

    async def reconcile_repair(
        self, *, leader: ResourceLease, found: Sequence[Inconsistency]
    ) -> list[bool]:
        """Apply each repair still valid, under the lock, once the leader is checked."""
        with self._lock:
            now = self.clock.now()
            self._check_leader(leader, "reconcile", now)
            return [self._repair(item, now) for item in found]

    def _repair(self, item: Inconsistency, now: float) -> bool:
        if item.kind is Drift.JOB_UNACKNOWLEDGED:
            return self._acknowledge(item, now)
        if item.kind is Drift.EFFECT_PENDING:
            effect = self._effects.get(item.key or "")
            if (
                effect is None
                or effect.status is not EffectStatus.PENDING
                or (effect.job_id, effect.token) != (item.job_id, item.token)
                or self._lease_live(effect.job_id, effect.token, now)
            ):
                return False
            self._effects[effect.key] = dataclasses.replace(
                effect, status=EffectStatus.FAILED, error=ABANDONED, updated_at=now
            )
            return True
        if item.kind is Drift.LEASE_ORPHANED:
            lease = self._leases.get(item.key or "")
            if lease is None or (lease.token, lease.owner) != (item.token, item.owner):
                return False
            if lease.expires_at <= now:
                return False
            # A token bump, never a delete: the holder's (owner, token) matches no more.
            self._leases[lease.resource] = dataclasses.replace(
                lease, token=lease.token + 1, expires_at=now
            )
            return True
        assert item.job_id is not None
        job = self._jobs.get(item.job_id)
        if job is None or (job.state is JobState.RUNNING and job.lease_token == item.token):
            return False
        attempts = self._attempts[job.id]
        for i, att in enumerate(attempts):
            if att.token == item.token and att.finished_at is None:
                attempts[i] = dataclasses.replace(
                    att, finished_at=now, outcome=LOST, error=LOST_ERROR, error_class="coordination"
                )
                return True
        return False

    def _acknowledge(self, item: Inconsistency, now: float) -> bool:
        assert item.job_id is not None
        job = self._jobs.get(item.job_id)
        if (
            job is None
            or job.lease_token != item.token
            or job.state.value != item.state
            or self._lease_live(job.id, job.lease_token, now)
        ):
            return False
        token = job.lease_token
        if job.state is not JobState.RUNNING:
            # Queued never goes straight to succeeded: the reconciler takes the job (a
            # new token, so no earlier holder matches), then completes it.
            token += 1
            job = self._move_job(job, state=JobState.RUNNING, lease_token=token, updated_at=now)
        self._close_attempt(job.id, token, ACKNOWLEDGED, None, now, ACKNOWLEDGED_ERROR)
        self._jobs[job.id] = self._move_job(
            job,
            state=JobState.SUCCEEDED,
            lease_owner=None,
            lease_expires_at=None,
            updated_at=now,
            finished_at=now,
        )
        return True


def _gone(worker: WorkerRecord, now: float) -> bool:
    """Whether a worker's membership is over: stopped, or expired by the store's clock."""
    return worker.state == "stopped" or worker.expires_at <= now
