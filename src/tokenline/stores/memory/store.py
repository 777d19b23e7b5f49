"""The in-memory reference store: the contract in its plainest form.

One process only (``memory://``). It is the model the other stores are tested against,
and the store of unit tests. A lock makes every method atomic, as a transaction would.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..._clock import Clock, SystemClock
from ..._errors import JobNotFoundError, NotSupportedError, StaleTokenError, StoreError
from ..._jobs import (
    Attempt,
    ClaimedJob,
    Finish,
    Job,
    JobState,
    Lease,
    NewJob,
    QueueStats,
    RescueCandidate,
    RescueReport,
    StaleCommit,
    WorkerRecord,
    can_transition,
    claim_key,
    finish_transition,
    renewal_was_stale,
    rescue_transition,
)
from ..._records import DuplicateKind, Fence
from ..base import (
    Capabilities,
    Depth,
    FencedTransaction,
    ResourceLease,
    Store,
    possible_job_id,
    possible_job_ids,
)
from ._transaction import MemoryDatabase, MemoryFencedTransaction, refusal
from .ledger import MemoryLedger
from .maintenance import MemoryMaintenance
from .retention import MemoryRetention

__all__ = ["MemoryStore"]

_READY = (JobState.QUEUED, JobState.SCHEDULED)


class MemoryStore(MemoryMaintenance, MemoryRetention, MemoryLedger, Store):
    """A store held in this process's memory; nothing survives the process."""

    capabilities = Capabilities(multi_process=False, transactional_completion=True, ledger=True)

    def __init__(self, *, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._attempts: dict[int, list[Attempt]] = {}
        self._next_id = 1
        self._paused: set[str] = set()
        self._stale: list[StaleCommit] = []
        self._workers: dict[str, WorkerRecord] = {}
        self._leases: dict[str, ResourceLease] = {}
        self._marks: dict[str, float] = {}
        self._ledger_init()
        #: The business database handed to ``ctx.transaction()`` (in-memory SQLite).
        self.database = MemoryDatabase()

    async def open(self) -> None:
        """Nothing to connect to."""

    async def migrate(self) -> None:
        """Nothing to migrate: the in-memory store has no schema version."""

    async def close(self) -> None:
        """Nothing to release."""

    # -- broker ---------------------------------------------------------------------------
    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        """Insert all ``jobs`` and return their ids."""
        if connection is not None:
            raise NotSupportedError("the in-memory store has no transactions to enqueue in")
        with self._lock:
            now = self.clock.now()
            return [self._insert(new, now) for new in jobs]

    def _insert(self, new: NewJob, now: float) -> int:
        """Insert one job under the lock; a unique job whose key is held: its holder."""
        if new.unique is not None:
            holder = self._unique_holder(new, self._next_id, now)
            if holder is not None:
                return holder
        run_at = new.run_at if new.run_at is not None else now + (new.delay or 0.0)
        job = Job(
            id=self._next_id,
            queue=new.queue,
            task=new.task,
            args=new.args,
            idempotency_key=new.idempotency_key,
            priority=new.priority,
            run_at=run_at,
            attempt=0,
            max_attempts=new.max_attempts,
            max_lease_expiries=new.max_lease_expiries,
            state=JobState.SCHEDULED if run_at > now else JobState.QUEUED,
            lease_owner=None,
            lease_token=0,
            lease_expires_at=None,
            last_error=None,
            error_class=None,
            created_at=now,
            updated_at=now,
            finished_at=None,
            timeout=new.timeout,
        )
        self._jobs[job.id] = job
        self._attempts[job.id] = []
        self._next_id += 1
        return job.id

    async def jobs_claim(
        self,
        *,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> list[ClaimedJob]:
        """Lease the best ready jobs to ``owner``, by effective priority."""
        with self._lock:
            now = self.clock.now()
            wanted = set(queues) - self._paused
            ready = [
                j
                for j in self._jobs.values()
                if j.state in _READY and j.run_at <= now and j.queue in wanted
            ]
            ready.sort(key=lambda j: claim_key(j.priority, j.run_at, j.id, now, priority_aging))
            claimed = []
            for job in ready[:limit]:
                token = job.lease_token + 1
                job = _moved(
                    job,
                    state=JobState.RUNNING,
                    attempt=job.attempt + 1,
                    lease_owner=owner,
                    lease_token=token,
                    lease_expires_at=now + ttl,
                    updated_at=now,
                )
                self._jobs[job.id] = job
                self._attempts[job.id].append(
                    Attempt(job.id, job.attempt, token, owner, now, None, None, None, None)
                )
                claimed.append(ClaimedJob(job, Lease(job.id, owner, token, now + ttl)))
            return claimed

    def _holds(self, lease: Lease) -> bool:
        job = self._jobs.get(lease.job_id)
        return (
            job is not None
            and job.state is JobState.RUNNING
            and job.lease_token == lease.token
            and job.lease_owner == lease.owner
        )

    def _record_stale(self, lease: Lease, operation: str, now: float) -> None:
        self._stale.append(StaleCommit(lease.job_id, lease.token, lease.owner, operation, now))

    async def job_leases_renew(
        self, *, owner: str, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | None]:
        """Extend each held, unexpired lease."""
        with self._lock:
            now = self.clock.now()
            out: list[Lease | None] = []
            for lease in leases:
                job = self._jobs.get(lease.job_id)
                if (
                    job is not None
                    and lease.owner == owner
                    and self._holds(lease)
                    and (job.lease_expires_at or 0) > now
                ):
                    self._jobs[job.id] = dataclasses.replace(
                        job, lease_expires_at=now + ttl, updated_at=now
                    )
                    out.append(dataclasses.replace(lease, expires_at=now + ttl))
                else:
                    holder_token = None if job is None else job.lease_token
                    holder_owner = None if job is None else job.lease_owner
                    if renewal_was_stale(holder_token, holder_owner, lease.token, owner):
                        self._record_stale(lease, "renew", now)
                    out.append(None)
            return out

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        """Apply each finish whose token is current."""
        with self._lock:
            now = self.clock.now()
            out = []
            for fin in finishes:
                job = self._jobs.get(fin.lease.job_id)
                if job is None or not self._holds(fin.lease):
                    self._record_stale(fin.lease, fin.outcome.value, now)
                    out.append(False)
                    continue
                self._jobs[job.id] = _finished(job, fin, now)
                self._close_attempt(job.id, fin.lease.token, fin.outcome.value, fin, now)
                out.append(True)
            return out

    def _close_attempt(
        self,
        job_id: int,
        token: int,
        outcome: str,
        fin: Finish | None,
        now: float,
        reason: str = "lease expired",
    ) -> None:
        attempts = self._attempts[job_id]
        for i, att in enumerate(attempts):
            if att.token == token and att.finished_at is None:
                attempts[i] = dataclasses.replace(
                    att,
                    finished_at=now,
                    outcome=outcome,
                    error=fin.error if fin else reason,
                    error_class=fin.error_class if fin else "coordination",
                )

    async def jobs_rescue(
        self, *, limit: int = 1000, leader: ResourceLease | None = None
    ) -> RescueReport:
        """Requeue (or dead-letter) running jobs whose lease has expired, if ``leader``
        (when given) still holds the maintenance lease."""
        with self._lock:
            now = self.clock.now()
            self._check_leader(leader, "rescue", now)
            requeued: list[int] = []
            dead: list[int] = []
            expired = [
                j
                for j in self._jobs.values()
                if j.state is JobState.RUNNING and (j.lease_expires_at or 0) <= now
            ][:limit]
            for job in expired:
                rescue = rescue_transition(
                    RescueCandidate(
                        job.id,
                        job.lease_token,
                        job.lease_owner,
                        job.attempt,
                        job.max_attempts,
                        job.lease_expiries,
                        job.max_lease_expiries,
                    )
                )
                move = rescue.transition
                self._close_attempt(
                    job.id, job.lease_token, "lease_expired", None, now, rescue.reason
                )
                self._jobs[job.id] = _moved(
                    job,
                    state=move.state,
                    attempt=job.attempt - move.refund,
                    lease_expiries=job.lease_expiries + 1,
                    lease_token=job.lease_token + 1,
                    lease_owner=None,
                    lease_expires_at=None,
                    run_at=job.run_at if move.delay is None else now + move.delay,
                    last_error=rescue.reason,
                    error_class="coordination",
                    updated_at=now,
                    finished_at=now if move.finished else None,
                )
                (dead if move.state is JobState.DEAD else requeued).append(job.id)
            return RescueReport(requeued=requeued, dead=dead)

    # -- queues ---------------------------------------------------------------------------
    async def queue_pause(self, *, queue: str) -> None:
        """Pause ``queue``."""
        with self._lock:
            self._paused.add(queue)

    async def queue_resume(self, *, queue: str) -> None:
        """Resume ``queue``."""
        with self._lock:
            self._paused.discard(queue)

    async def queues_stats(self) -> list[QueueStats]:
        """Per-queue counts and oldest ready age."""
        with self._lock:
            now = self.clock.now()
            counts: dict[str, dict[str, int]] = {}
            oldest: dict[str, float] = {}
            for job in self._jobs.values():
                c = counts.setdefault(job.queue, {})
                c[job.state.value] = c.get(job.state.value, 0) + 1
                if job.state in _READY and job.run_at <= now:
                    oldest[job.queue] = min(oldest.get(job.queue, now), job.run_at)
            names = sorted(set(counts) | self._paused)
            return [
                QueueStats(
                    q,
                    counts.get(q, {}),
                    (now - oldest[q]) if q in oldest else None,
                    q in self._paused,
                )
                for q in names
            ]

    async def jobs_depth(self) -> list[Depth]:
        """Unfinished jobs per queue, task and state; runnable ones count as queued."""
        with self._lock:
            now = self.clock.now()
            counts: dict[tuple[str, str, str], int] = {}
            for job in self._jobs.values():
                if job.state in _READY:
                    state = "queued" if job.run_at <= now else "scheduled"
                elif job.state is JobState.RUNNING:
                    state = "running"
                else:
                    continue
                key = (job.queue, job.task, state)
                counts[key] = counts.get(key, 0) + 1
            return [Depth(*key, n) for key, n in sorted(counts.items())]

    # -- inspection -----------------------------------------------------------------------
    async def job_get(self, *, job_id: int) -> Job:
        """The job, or :class:`JobNotFoundError`."""
        if not possible_job_id(job_id):
            raise JobNotFoundError(f"no job with id {job_id}")
        with self._lock:
            try:
                return self._jobs[job_id]
            except KeyError:
                raise JobNotFoundError(f"no job with id {job_id}") from None

    async def jobs_list(
        self,
        *,
        state: JobState | None = None,
        queue: str | None = None,
        limit: int = 100,
        args_limit: int | None = None,
    ) -> list[Job]:
        """Jobs filtered by state and queue, newest first (``args`` cut to ``args_limit``)."""
        with self._lock:
            jobs = [
                j
                for j in self._jobs.values()
                if (state is None or j.state is state) and (queue is None or j.queue == queue)
            ]
            listed = sorted(jobs, key=lambda j: -j.id)[:limit]
        if args_limit is None:
            return listed
        return [dataclasses.replace(j, args=j.args[:args_limit]) for j in listed]

    async def job_attempts(self, *, job_id: int) -> list[Attempt]:
        """Attempts of the job, oldest first."""
        with self._lock:
            if not possible_job_id(job_id) or job_id not in self._jobs:
                raise JobNotFoundError(f"no job with id {job_id}")
            return list(self._attempts[job_id])

    async def jobs_retry_dead(self, *, job_ids: Sequence[int]) -> int:
        """Requeue dead jobs with a fresh budget of their own ``max_attempts``."""
        with self._lock:
            now = self.clock.now()
            n = 0
            for jid in possible_job_ids(job_ids):
                job = self._jobs.get(jid)
                if job is not None and job.state is JobState.DEAD:
                    self._jobs[jid] = _moved(
                        job,
                        state=JobState.QUEUED,
                        attempt=0,
                        lease_expiries=0,
                        run_at=now,
                        finished_at=None,
                        updated_at=now,
                    )
                    n += 1
            return n

    async def jobs_cancel(self, *, job_ids: Sequence[int], reason: str) -> int:
        """Cancel jobs that are queued, scheduled or dead."""
        with self._lock:
            now = self.clock.now()
            n = 0
            for jid in possible_job_ids(job_ids):
                job = self._jobs.get(jid)
                if job is not None and job.state in (*_READY, JobState.DEAD):
                    self._jobs[jid] = _moved(
                        job,
                        state=JobState.CANCELLED,
                        last_error=reason,
                        error_class=None,  # the reason is the operator's, of no class
                        finished_at=now,
                        updated_at=now,
                    )
                    n += 1
            return n

    async def stale_commits(self, *, limit: int = 100) -> tuple[int, list[StaleCommit]]:
        """Total refused writes and the most recent ``limit``."""
        with self._lock:
            return len(self._stale), list(reversed(self._stale))[:limit]

    # -- workers and leases ---------------------------------------------------------------
    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        """Register ``record`` with a fresh token."""
        with self._lock:
            now = self.clock.now()
            old = self._workers.get(record.id)
            rec = dataclasses.replace(
                record,
                token=(old.token if old else 0) + 1,
                heartbeat_at=now,
                expires_at=now + ttl,
                started_at=old.started_at if old else now,
                # An operator's drain, asked before this re-registration, still holds.
                drain_requested=old.drain_requested if old else False,
            )
            self._workers[record.id] = rec
            return rec

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
        with self._lock:
            now = self.clock.now()
            rec = self._workers.get(worker_id)
            if rec is None or rec.token != token or rec.expires_at <= now:
                return None
            rec = dataclasses.replace(
                rec,
                state=state,
                in_flight=in_flight,
                heartbeat_at=now,
                expires_at=now + ttl,
                clock_skew=rec.clock_skew if skew is None else skew,
                concurrency_limit=(
                    rec.concurrency_limit if concurrency_limit is None else concurrency_limit
                ),
            )
            self._workers[worker_id] = rec
            return rec

    async def store_time(self) -> float:
        """This process's clock: the in-memory store lives in it."""
        return self.clock.now()

    async def worker_deregister(self, *, worker_id: str, token: int) -> None:
        """Mark the worker stopped."""
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is not None and rec.token == token:
                now = self.clock.now()
                self._workers[worker_id] = dataclasses.replace(
                    rec, state="stopped", in_flight=0, heartbeat_at=now, expires_at=now
                )

    async def workers_list(self) -> list[WorkerRecord]:
        """All workers, newest first."""
        with self._lock:
            return sorted(self._workers.values(), key=lambda w: -w.started_at)

    async def worker_drain(self, *, worker_id: str) -> bool:
        """Mark the worker's live membership as asked to drain."""
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is None or rec.state == "stopped" or rec.expires_at <= self.clock.now():
                return False
            self._workers[worker_id] = dataclasses.replace(rec, drain_requested=True)
            return True

    async def resource_lease_acquire(
        self, *, resource: str, owner: str, ttl: float
    ) -> ResourceLease | None:
        """Take or renew the named lease."""
        with self._lock:
            now = self.clock.now()
            cur = self._leases.get(resource)
            if cur is not None and cur.expires_at > now and cur.owner != owner:
                return None
            if cur is not None and cur.owner == owner and cur.expires_at > now:
                new = dataclasses.replace(cur, expires_at=now + ttl)
            else:
                token = (cur.token if cur else 0) + 1
                new = ResourceLease(resource, owner, token, now + ttl, acquired_at=now)
            self._leases[resource] = new
            return new

    async def resource_lease_release(self, *, lease: ResourceLease) -> bool:
        """Release the lease if ``(owner, token)`` still holds it."""
        with self._lock:
            cur = self._leases.get(lease.resource)
            if cur is None or cur.owner != lease.owner or cur.token != lease.token:
                return False
            # Expire rather than delete: the token counter must survive the release.
            self._leases[lease.resource] = dataclasses.replace(cur, expires_at=self.clock.now())
            return True

    async def resource_leases_list(self) -> list[ResourceLease]:
        """Every named lease, held or not, by resource name."""
        with self._lock:
            return [self._leases[name] for name in sorted(self._leases)]

    def _move_job(self, job: Job, **changes: Any) -> Job:
        """``job`` with ``changes``, by the state machine (for the maintenance mixin)."""
        return _moved(job, **changes)

    # -- transactions ---------------------------------------------------------------------
    def fenced_transaction(
        self, *, lease: Lease, fences: Sequence[Fence] = (), timeout: float | None = None
    ) -> FencedTransaction:
        """A transaction on the store's in-memory business database (``?`` parameters),
        checked and completed as on SQLite; see ``_memory_transaction.py``."""
        return MemoryFencedTransaction(self, lease, fences)

    def check_transaction(self, lease: Lease, fences: Sequence[Fence]) -> StaleTokenError | None:
        """The refusal of a transaction's start (recorded), or ``None``."""
        with self._lock:
            now = self.clock.now()
            if not self._holds(lease):
                self._record_stale(lease, "transaction", now)
                return refusal(lease, None)
            for fence in fences:
                if not self._fence_ok(lease, fence, now):
                    self._duplicate(fence.key, DuplicateKind.STALE, "fence", lease, now)
                    return refusal(lease, fence)
            return None

    def commit_transaction(
        self, finish: Finish, fences: Sequence[Fence], commit: Callable[[], None]
    ) -> StaleTokenError | None:
        """Check the token again, advance ``fences``, run ``commit`` (the user's writes)
        and complete the job, all under the store's lock; or the refusal (recorded)."""
        lease = finish.lease
        with self._lock:
            now = self.clock.now()
            if not self._holds(lease):
                self._record_stale(lease, "transaction", now)
                return refusal(lease, None)
            refused = self._fences_apply(lease, fences, now)
            if refused is not None:
                return refusal(lease, refused)
            commit()
            job = self._jobs[lease.job_id]
            self._jobs[job.id] = _finished(job, finish, now)
            self._close_attempt(job.id, lease.token, finish.outcome.value, finish, now)
            return None


def _moved(job: Job, **changes: Any) -> Job:
    """``job`` with ``changes``, refusing a state move that ALLOWED_TRANSITIONS forbids —
    what the SQL stores' triggers do, here in the reference store."""
    state = changes.get("state", job.state)
    if state is not job.state and not can_transition(job.state, state):
        raise StoreError(f"illegal job state transition {job.state.value} -> {state.value}")
    return dataclasses.replace(job, **changes)


def _finished(job: Job, fin: Finish, now: float) -> Job:
    """The job after ``fin`` was accepted, by the core's :func:`finish_transition`."""
    move = finish_transition(fin)
    return _moved(
        job,
        state=move.state,
        run_at=job.run_at if move.delay is None else now + move.delay,
        attempt=job.attempt - move.refund,
        lease_owner=None,
        lease_expires_at=None,
        updated_at=now,
        last_error=fin.error,
        error_class=fin.error_class,
        finished_at=now if move.finished else None,
    )
