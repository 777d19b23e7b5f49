"""The backend seam: one method per atomic state change, cut along DESIGN.md's roles.

* :class:`Broker` distributes work: enqueue, claim with a lease, finish, rescue, queues.
* :class:`Leases` coordinates: job lease renewal, worker membership, resource leases,
  and the store's clock.
* :class:`Ledger` holds business truth: fenced transactions, effects, fences, the audit.
* :class:`Store` plays all three, and adds ``open``, ``close`` and ``migrate``.

Each method's role is declared once, by the class that declares the method
(:data:`ROLES`); the drill's per-role fault injection reads it from there. A backend
that plays some roles only (a broker and lease store without a ledger) implements those
classes. Nothing here assumes SQL.

A store is a thin adapter; the rules (state machine, fencing, retries) live in the core.
What every store must guarantee:

* **Fenced writes.** ``jobs_finish`` and ``job_leases_renew`` apply a row only if the job
  is ``running`` *and* its ``lease_token`` equals the token presented, checked inside the
  store's own atomic statement (``UPDATE … WHERE id = ? AND lease_token = ?``), never
  by a read followed by a write. A refused write is recorded (see ``stale_commits``)
  and reported to the caller; it is never swallowed.
* **Monotonic tokens.** Every claim and every rescue increments the job's token, so a
  worker that held an older lease can never match again.
* **Monotonic states.** Transitions follow :data:`tokenline._jobs.ALLOWED_TRANSITIONS`.
* **Store time.** Lease expiry is judged by the store's clock, not the worker's.
* **Unique enqueue.** A job with ``unique`` set takes its idempotency key in the store's
  key table with one ``INSERT … ON CONFLICT`` (never a read followed by a write); while
  the key is held by an earlier job, the enqueue returns that job's id instead.
* **The ledger** (stores with ``capabilities.ledger``): every ledger write checks the
  job's token first, in the same transaction; per effect key the owner of a pending
  record, and per fence key the highest token that wrote, decide who may write next;
  every refusal and every repeat of a completed effect is recorded as a duplicate.

Methods are keyword-only and async; a store that blocks (SQLite) runs its calls off the
event loop. Capabilities say what a store lacks.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import NotSupportedError, StaleTokenError, StoreError
from .._jobs import (
    Attempt,
    ClaimedJob,
    Finish,
    Job,
    JobState,
    Lease,
    NewJob,
    Outcome,
    QueueStats,
    RescueReport,
    StaleCommit,
    WorkerRecord,
)
from .._records import Duplicate, EffectBegin, EffectRecord, Fence

log = logging.getLogger("tokenline.store")

__all__ = [
    "MAX_JOB_ID",
    "ROLES",
    "Broker",
    "Capabilities",
    "Depth",
    "Drift",
    "EventLoopNeeded",
    "FencedTransaction",
    "Inconsistency",
    "Leases",
    "Ledger",
    "PruneKind",
    "ResourceLease",
    "Role",
    "Store",
    "leader_refused",
]


class EventLoopNeeded(NotSupportedError):
    """Raised by :meth:`Broker.jobs_enqueue_blocking` when this call must take the
    store's async path (a new fencing epoch must be taken first, say); nothing was
    written, and the app sends the same call through its event loop."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store can do beyond the common contract."""

    #: Several processes may share the store (false for the in-memory store).
    multi_process: bool = True
    #: ``fenced_transaction``: business writes and the job's completion in one transaction.
    transactional_completion: bool = False
    #: The store wakes idle workers when a job is enqueued.
    notifications: bool = False
    #: Effects, fences, fenced resource-lease renewal and duplicate accounting.
    ledger: bool = False
    #: Ledger writes (effects, fences) from inside the job's own open fenced
    #: transaction wait for that transaction, forever: SQLite has one writer at a time,
    #: and the split ledger's fence check holds the job's fence row the write needs.
    ledger_waits_for_transaction: bool = False
    #: So do resource leases (``ctx.lease``): on SQLite, whose one writer is the job's
    #: transaction; the split topology keeps them on Redis, which waits for nothing.
    lease_waits_for_transaction: bool = False
    #: The parameter marker of the connection a fenced transaction hands out.
    placeholder: str = "?"
    #: ``jobs_enqueue_blocking``: an open store enqueues for a synchronous caller on the
    #: caller's own thread, without an event loop in between.
    blocking_enqueue: bool = False


@dataclass(frozen=True, slots=True)
class ResourceLease:
    """A named lease (maintenance leadership, a business resource) with its token."""

    resource: str
    owner: str
    token: int
    expires_at: float
    #: When its current token was issued, by the store's clock, as
    #: :meth:`Leases.resource_leases_list` reports it (``None`` where unknown: a lease
    #: taken before the store recorded it). Not part of the lease's identity.
    acquired_at: float | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Depth:
    """How many unfinished jobs of one task wait or run in one queue.

    ``state``: ``queued`` (runnable now: its ``run_at`` has come, by the store's clock),
    ``scheduled`` (waiting for its ``run_at``) or ``running``. The stored state does not
    say which of the first two a job is: a scheduled job becomes runnable in place.
    """

    queue: str
    task: str
    state: str
    count: int


class Drift(enum.StrEnum):
    """The kinds of disagreement the reconciler looks for (DESIGN.md section 7)."""

    #: The job's fenced transaction committed (an attempt ``succeeded``), yet the job is
    #: still queued, scheduled, or running under an expired lease: acknowledge it. An
    #: effect of the job's own key proves only that the effect ran, never the handler.
    JOB_UNACKNOWLEDGED = "job_unacknowledged"
    #: An effect key left ``pending`` by an attempt whose lease is gone, for longer than
    #: the deadline: mark it ``failed`` so that the job's next attempt may run it.
    EFFECT_PENDING = "effect_pending_expired"
    #: A resource lease still held by a worker whose membership is over: expire it by
    #: bumping its token (never a delete: the counter must survive).
    LEASE_ORPHANED = "lease_orphaned"
    #: An attempt with no outcome whose job has moved on (another token, or finished):
    #: close it as lost.
    ATTEMPT_OPEN = "attempt_open"
    #: The split topology only: a job the ledger has seen (it holds the job's fence but
    #: not its completion) that the broker no longer holds at all, lost with a Redis
    #: server that failed over or restarted without the last writes. It cannot be
    #: repaired, its payload went with it: it is flagged in the ledger, once, and the
    #: attempt that held it may write nothing more there.
    JOB_LOST = "job_lost_from_broker"


@dataclass(frozen=True, slots=True)
class Inconsistency:
    """One disagreement found by :meth:`Ledger.reconcile_find`, with what was seen.

    The repair is conditional on what was seen: ``token`` (the job's lease token, the
    effect's token, or the resource lease's token) and ``state`` (the job's), so a
    repair of something that changed since is refused, never applied blindly.
    """

    kind: Drift
    #: The job concerned (``None`` for a resource lease).
    job_id: int | None
    token: int
    #: The effect key or the resource name (``None`` for a job or an attempt).
    key: str | None = None
    #: The owner seen: of the attempt, effect or resource lease.
    owner: str | None = None
    #: The job's state seen (``None`` where no job is concerned).
    state: str | None = None

    def describe(self) -> str:
        """One line naming what disagrees, for logs and ``tokenline reconcile``."""
        if self.kind is Drift.JOB_UNACKNOWLEDGED:
            return f"job {self.job_id} ({self.state}, token {self.token}) already committed"
        if self.kind is Drift.EFFECT_PENDING:
            return (
                f"effect {self.key!r} pending under job {self.job_id} token {self.token} "
                f"of {self.owner}, whose lease is gone"
            )
        if self.kind is Drift.LEASE_ORPHANED:
            return f"lease {self.key!r} (token {self.token}) held by {self.owner}, who is gone"
        if self.kind is Drift.JOB_LOST:
            return (
                f"job {self.job_id} (token {self.token} of {self.owner}) is in the ledger, not "
                "done, and gone from the broker: it cannot be repaired (its payload is lost "
                "with it); enqueue it again from the business data if it must still run"
            )
        return f"attempt of job {self.job_id} token {self.token} by {self.owner} left open"


def leader_refused(leader: ResourceLease, operation: str) -> StaleTokenError:
    """The error of a maintenance write refused because ``leader`` no longer holds the
    maintenance lease (a newer leader exists, or the lease expired)."""
    return StaleTokenError(resource=leader.resource, token=leader.token, operation=operation)


class FencedTransaction(abc.ABC):
    """A transaction on the store in which the job's token is checked first.

    Used as ``with`` (sync handlers) or ``async with`` (async handlers). On entry the
    store locks the job and verifies its token (raising :class:`StaleTokenError` before
    any user write); on a clean exit it marks the job succeeded and commits everything
    together; on an exception it rolls back.
    """

    #: True once the job's completion has committed with the user's writes.
    committed: bool = False
    #: True once the transaction's COMMIT ran (the user's writes are durable).
    wrote: bool = False

    @abc.abstractmethod
    def __enter__(self) -> Any: ...

    @abc.abstractmethod
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...

    async def __aenter__(self) -> Any:
        raise NotSupportedError("this store's transactions are synchronous: use `with`")

    async def _enter_on_a_thread(self) -> Any:
        """``__enter__`` on a thread, for an ``async with`` whose begin may wait for a
        lock. A caller cancelled meanwhile (a hard timeout, a fenced worker) leaves the
        thread to take the lock all the same: the transaction is rolled back as soon as
        it has begun, or the lock would stay held for ever."""
        entering = asyncio.ensure_future(asyncio.to_thread(self.__enter__))
        try:
            return await asyncio.shield(entering)
        except asyncio.CancelledError:
            entering.add_done_callback(self._abandoned_enter)
            raise

    def _abandoned_enter(self, entering: asyncio.Future[Any]) -> None:
        if not entering.cancelled() and entering.exception() is None:
            self.__exit__(asyncio.CancelledError, asyncio.CancelledError(), None)

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        raise NotSupportedError("this store's transactions are synchronous: use `with`")


class Role(enum.StrEnum):
    """The three roles of DESIGN.md section 2; every seam method belongs to one."""

    BROKER = "broker"
    LEASES = "leases"
    LEDGER = "ledger"


class PruneKind(enum.StrEnum):
    """What :meth:`Broker.maintenance_prune` deletes, each past its own retention.

    ``finished``: succeeded and cancelled jobs; ``dead``: dead jobs (dead letters are
    for operators: they get a retention of their own). A pruned job takes its attempts
    and its released unique key with it (a key held for good, ``unique="always"``
    without ``unique_for``, stays). ``stale_commits`` and ``duplicates``: audit rows.
    Effect records and fences are never pruned: they are what refuses a repeated
    business effect or a stale write, whatever their age.
    """

    FINISHED = "finished"
    DEAD = "dead"
    STALE_COMMITS = "stale_commits"
    DUPLICATES = "duplicates"


class Broker(abc.ABC):
    """Distributes work: enqueue, claim with a lease, finish (each conditional on the
    token), rescue, pause and resume, depth and age, and the job records."""

    @abc.abstractmethod
    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        """Insert ``jobs`` atomically (all or none) and return their ids, in order.

        With ``connection`` (a driver connection inside the caller's open transaction),
        the jobs are inserted in that transaction: they exist if and only if it commits
        (the outbox pattern). Stores that cannot do this raise NotSupportedError.
        """

    def jobs_enqueue_blocking(self, *, jobs: Sequence[NewJob]) -> list[int]:
        """:meth:`jobs_enqueue` for ordinary synchronous code, on the caller's thread
        (any thread without a running event loop), once the store is open.

        The same statement and guarantees as :meth:`jobs_enqueue`, without the hop to an
        event loop: what makes a single enqueue from web code cheap. Stores that can
        (``capabilities.blocking_enqueue``) override it; the others raise
        :class:`NotSupportedError`, and the app goes through its event loop instead;
        :class:`EventLoopNeeded` asks for that for one call.
        """
        raise NotSupportedError(f"{type(self).__name__} has no blocking enqueue")

    # The timeout is the poll period, not a deadline for the caller to impose.

    @abc.abstractmethod
    async def jobs_claim(
        self,
        *,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> list[ClaimedJob]:
        """Lease up to ``limit`` ready jobs of unpaused ``queues`` to ``owner``.

        Highest priority first, then oldest ``run_at``, then lowest id. With
        ``priority_aging`` (seconds, > 0), the priority is the effective one: a job
        gains a point per ``priority_aging`` seconds since its ``run_at`` by the store's
        clock (:func:`tokenline._jobs.claim_key`); ``None``: its own priority. The claim
        still reads a bounded number of rows per queue, whatever the backlog. Each job's
        attempt and token are incremented; the lease expires ``ttl`` seconds from the
        store's now. The jobs are returned in that order.
        """

    @abc.abstractmethod
    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        """Apply finalising writes in one batch, each conditional on its own token.

        Returns, in order, whether each was accepted. Refused ones are recorded as stale
        commits.
        """

    async def jobs_finish_and_claim(
        self,
        *,
        finishes: Sequence[Finish],
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> tuple[list[bool], list[ClaimedJob]]:
        """:meth:`jobs_finish`, then :meth:`jobs_claim` of up to ``limit`` jobs: a
        worker whose jobs just finished asks for the next ones in the same request.

        Each finish is fenced by its own token exactly as in :meth:`jobs_finish`; the
        claim is an ordinary claim. If the finish fails, nothing is claimed. Stores
        override this to do both in one round trip (and one transaction); this default
        makes the two calls, and once the finishes are answered a failed claim claims
        nothing and raises nothing: raising would tell the caller its finishes failed
        when they were made, and a worker told so would retry them (refused, as stale)
        or lose trust in leases it had itself given back. The worker's next claim meets
        the failure again, and counts it.
        """
        done = await self.jobs_finish(finishes=finishes)
        if limit <= 0:
            return done, []
        try:
            claimed = await self.jobs_claim(
                owner=owner, queues=queues, limit=limit, ttl=ttl, priority_aging=priority_aging
            )
        except StoreError as exc:
            log.warning("finished %d jobs, then the claim beside them failed: %s", len(done), exc)
            return done, []
        return done, claimed

    @abc.abstractmethod
    async def jobs_rescue(
        self, *, limit: int = 1000, leader: ResourceLease | None = None
    ) -> RescueReport:
        """Return running jobs whose lease expired to the queue, bumping their token.

        The lost attempt counts: a job on its last attempt goes dead instead.

        ``leader``: the maintenance lease the caller holds. The store checks, in the
        same transaction as the rescue, that it still holds it (owner, token, unexpired
        by the store's clock), and raises :class:`StaleTokenError` having changed
        nothing when it does not: a deposed leader's rescue is refused. ``None``: an
        unfenced pass (tests, operators); each row is still taken only if its lease
        expired, inside one statement, so no live job is ever taken.
        """

    @abc.abstractmethod
    async def queue_pause(self, *, queue: str) -> None:
        """Stop claims from ``queue`` (jobs stay queued)."""

    @abc.abstractmethod
    async def queue_resume(self, *, queue: str) -> None:
        """Allow claims from ``queue`` again."""

    @abc.abstractmethod
    async def queues_stats(self) -> list[QueueStats]:
        """Counts per state and oldest ready age, per queue (paused ones flagged)."""

    @abc.abstractmethod
    async def jobs_depth(self) -> list[Depth]:
        """Unfinished jobs counted per queue, task and state (see :class:`Depth`), in one
        read; a combination without jobs is left out. Ordered by queue, task, state."""

    @abc.abstractmethod
    async def job_get(self, *, job_id: int) -> Job:
        """The job with ``job_id``; :class:`JobNotFoundError` if there is none."""

    @abc.abstractmethod
    async def jobs_list(
        self,
        *,
        state: JobState | None = None,
        queue: str | None = None,
        limit: int = 100,
        args_limit: int | None = None,
    ) -> list[Job]:
        """Jobs filtered by state and queue, newest first.

        ``args_limit``: each job's ``args`` cut to at most that many characters (0: none
        of them), for a listing that does not show them whole: a payload may be
        megabytes, and a listing of many read whole held as many in memory. ``None``:
        whole."""

    @abc.abstractmethod
    async def job_attempts(self, *, job_id: int) -> list[Attempt]:
        """Every attempt of the job, oldest first, with its token and outcome."""

    @abc.abstractmethod
    async def jobs_retry_dead(self, *, job_ids: Sequence[int]) -> int:
        """Operator action: move dead jobs back to queued with a fresh budget: attempt
        back to 0 of the job's own ``max_attempts``, lease expiries back to 0. The token
        is kept (the next claim bumps it, as always); the attempt history stays. Returns
        how many were dead and moved."""

    @abc.abstractmethod
    async def jobs_cancel(self, *, job_ids: Sequence[int], reason: str) -> int:
        """Cancel jobs that are not running or finished (dead ones: discard)."""

    @abc.abstractmethod
    async def stale_commits(self, *, limit: int = 100) -> tuple[int, list[StaleCommit]]:
        """The total number of refused stale writes and the most recent ones."""

    # -- maintenance (run by the leader; see maintenance/) -------------------------------
    # Not abstract: a store without them says so (NotSupportedError), the rest of the
    # contract still holds.

    async def maintenance_prune(
        self, *, leader: ResourceLease, kind: PruneKind, before: float, limit: int
    ) -> int:
        """Delete up to ``limit`` rows of ``kind`` (see :class:`PruneKind`) that
        finished, or were recorded, before ``before`` (epoch seconds, the store's
        clock), in one short transaction; return how many (jobs, for the
        job kinds).

        The transaction first checks that ``leader`` still holds its resource lease
        (same owner and token, unexpired by the store's clock); if not, nothing is
        deleted and :class:`StaleTokenError` is raised. A queued, scheduled or running
        job, and a held unique key, are never touched.
        """
        raise NotSupportedError(f"{type(self).__name__} does not prune")

    async def maintenance_prunable(self, *, kind: PruneKind, before: float) -> int:
        """How many rows :meth:`maintenance_prune` would delete in all (dry runs)."""
        raise NotSupportedError(f"{type(self).__name__} does not prune")

    async def schedule_advance(
        self, *, leader: ResourceLease, schedule: str, instant: float, job: NewJob | None
    ) -> bool:
        """Move ``schedule``'s high-water mark to ``instant`` and enqueue ``job`` (if
        any) in the same transaction, only if the mark is below ``instant``.

        ``True`` when the mark moved (and the job was enqueued); ``False`` when the
        mark was already at or past ``instant``: that instant was handled before, by
        this leader or another, and nothing is written. The transaction first checks
        ``leader`` as :meth:`maintenance_prune` does (:class:`StaleTokenError`).
        """
        raise NotSupportedError(f"{type(self).__name__} does not run periodic jobs")

    async def schedule_marks(self) -> dict[str, float]:
        """Every schedule's high-water mark: the last instant it handled (epoch s)."""
        raise NotSupportedError(f"{type(self).__name__} does not run periodic jobs")

    # -- conveniences built on the primitives ---------------------------------------------
    async def wait_for_jobs(self, *, queues: Sequence[str], timeout: float) -> None:  # noqa: ASYNC109
        """Return when jobs may be ready in ``queues``, or after ``timeout`` seconds.

        The default polls; stores with notifications return early on an enqueue.
        """
        await asyncio.sleep(timeout)

    async def job_complete(self, *, lease: Lease) -> None:
        """Mark the job succeeded; raise :class:`StaleTokenError` if the token is stale."""
        await self._finish_one(Finish(lease, Outcome.SUCCEEDED), "complete")

    async def job_retry(
        self, *, lease: Lease, delay: float, error: str, error_class: str = "transient"
    ) -> None:
        """Schedule another attempt ``delay`` seconds from the store's now; the attempt
        is burned."""
        await self._finish_one(Finish(lease, Outcome.RETRY, delay, error, error_class), "retry")

    async def job_dead(self, *, lease: Lease, error: str, error_class: str = "permanent") -> None:
        """Dead-letter the job with ``error`` as its reason."""
        await self._finish_one(Finish(lease, Outcome.DEAD, None, error, error_class), "dead")

    async def job_snooze(self, *, lease: Lease, delay: float, reason: str = "snoozed") -> None:
        """Put the job back for ``delay`` seconds without burning an attempt."""
        await self._finish_one(
            Finish(lease, Outcome.RELEASE, delay, reason, "coordination"), "snooze"
        )

    async def _finish_one(self, finish: Finish, operation: str) -> None:
        (ok,) = await self.jobs_finish(finishes=[finish])
        if not ok:
            raise StaleTokenError(
                resource=f"job {finish.lease.job_id}",
                token=finish.lease.token,
                operation=operation,
            )


class Leases(abc.ABC):
    """Coordination: job lease renewal, worker membership, resource leases (maintenance
    leadership, business resources), each with monotonic tokens, on the store's clock."""

    @abc.abstractmethod
    async def job_leases_renew(
        self, *, owner: str, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | None]:
        """Extend each lease still held (same token, not expired): one batch.

        Returns, in order, the renewed lease or ``None`` for a lease that is lost.
        """

    @abc.abstractmethod
    async def store_time(self) -> float:
        """The store's clock now (epoch seconds): what every lease, schedule and
        timestamp of this store is measured by, whatever the caller's clock says."""

    @abc.abstractmethod
    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        """Insert or re-register a worker, issuing a fresh membership token; the new
        membership starts with the record's ``concurrency_limit``."""

    @abc.abstractmethod
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
        """Extend the membership lease if still held; ``None`` when it was lost.

        ``skew``: the worker's wall clock minus the store's, as it last measured it
        (kept with the row for operators; ``None`` keeps the previous value).
        ``concurrency_limit``: the worker's adaptive concurrency limit now (kept with
        the row for operators; ``None`` keeps the previous value).
        """

    @abc.abstractmethod
    async def worker_deregister(self, *, worker_id: str, token: int) -> None:
        """Mark the worker stopped (best effort, conditional on its token)."""

    @abc.abstractmethod
    async def workers_list(self) -> list[WorkerRecord]:
        """Every worker row, newest first."""

    @abc.abstractmethod
    async def worker_drain(self, *, worker_id: str) -> bool:
        """Operator action: mark the live membership of ``worker_id`` as asked to drain
        (``drain_requested``, which ``worker_heartbeat`` and ``workers_list`` return).

        ``True`` when a live membership (unexpired by the store's clock, not stopped)
        was marked; ``False`` for an unknown worker or one no longer live, whose row is
        left unchanged. Asking twice is harmless. ``worker_register`` starts a new
        membership without the mark.
        """

    @abc.abstractmethod
    async def resource_lease_acquire(
        self, *, resource: str, owner: str, ttl: float
    ) -> ResourceLease | None:
        """Take the named lease if it is free or expired (new token), or renew it if
        ``owner`` already holds it; ``None`` when someone else holds it."""

    @abc.abstractmethod
    async def resource_lease_renew(
        self, *, lease: ResourceLease, ttl: float
    ) -> ResourceLease | None:
        """Extend the named lease only if ``(owner, token)`` still holds it unexpired;
        ``None`` when it is lost (recorded as a stale write when someone else holds it)."""

    @abc.abstractmethod
    async def resource_lease_release(self, *, lease: ResourceLease) -> bool:
        """Release the named lease; only the holder of ``(owner, token)`` can."""

    @abc.abstractmethod
    async def resource_leases_list(self) -> list[ResourceLease]:
        """Every named lease the store holds a record of, by resource name, with
        ``acquired_at``: held ones, and expired or released ones, which keep their last
        holder and token (the next holder's token is higher)."""


class Ledger(abc.ABC):
    """Business truth: fenced transactions, effects once per key, fences, and the audit
    of every duplicate and refused write."""

    @abc.abstractmethod
    def fenced_transaction(
        self, *, lease: Lease, fences: Sequence[Fence] = (), timeout: float | None = None
    ) -> FencedTransaction:
        """A transaction that checks ``lease`` first, then advances each of ``fences``
        (refusing a lower token), and completes the job on commit.

        ``timeout``: how long the caller may keep it open (the attempt's remaining
        time); a store that bounds its sessions' idle time uses it instead of its own.
        """

    @abc.abstractmethod
    async def effect_begin(self, *, lease: Lease, key: str) -> EffectBegin:
        """Take ``key`` (status ``pending``) for the attempt holding ``lease``, if allowed.

        In one transaction: the job's token is checked first (refused: ``STALE``). Then a
        new key, a ``failed`` one, or one left ``pending`` by an attempt that lost its
        lease is taken (``RUN``); within one job only by a newer token. A ``completed`` key
        answers ``DONE`` with its record and records a repeat; a key pending under a live
        lease answers ``BUSY``. Every ``STALE`` is recorded as a duplicate.
        """

    @abc.abstractmethod
    async def effect_finish(
        self, *, lease: Lease, key: str, result: str | None = None, error: str | None = None
    ) -> bool:
        """Mark the key ``completed`` with ``result`` (JSON text), or ``failed`` with
        ``error``, only if it is still pending under this attempt's token. Neither
        given: ``completed`` without a result (the effect ran; its result was unstorable).

        The job's lease need not be current any more: the effect has happened, and
        refusing its record would only make it happen again. A refusal (a newer token
        took the key) is recorded as a stale duplicate and returns ``False``.
        """

    @abc.abstractmethod
    async def effects_list(
        self, *, job_id: int | None = None, key: str | None = None, limit: int = 100
    ) -> list[EffectRecord]:
        """Effect records, newest first, filtered by the job that wrote last or by key."""

    @abc.abstractmethod
    async def fence_write(self, *, lease: Lease, fence: Fence) -> bool:
        """Record ``fence.token`` as the highest for ``(key, issuer)`` in one transaction
        that first checks the job's token (and the issuing resource lease, if any).

        ``False`` (recorded as a stale duplicate) when the job's lease or the resource
        lease is lost, or a higher token of the same issuer has already written.
        """

    @abc.abstractmethod
    async def reconcile_find(
        self, *, pending_deadline: float, limit: int = 1000
    ) -> list[Inconsistency]:
        """Read-only: every :class:`Inconsistency` of each :class:`Drift` kind, by the
        store's clock (an effect is judged once pending longer than
        ``pending_deadline`` seconds), at most ``limit`` of each kind."""

    @abc.abstractmethod
    async def reconcile_repair(
        self, *, leader: ResourceLease, found: Sequence[Inconsistency]
    ) -> list[bool]:
        """Repair each of ``found`` in one transaction that first checks that ``leader``
        holds the maintenance lease (else :class:`StaleTokenError`, nothing changed).

        Each repair is conditional on what was seen (its token and state); returns, in
        order, whether each was applied (``False``: it changed since, left alone).
        """

    @abc.abstractmethod
    async def duplicates_list(
        self, *, since: float | None = None, limit: int = 10_000
    ) -> list[Duplicate]:
        """Recorded duplicates, newest first: ledger repeats and refusals, and every job
        commit refused for a stale token (keyed by the job's idempotency key, or
        ``job:<id>`` without one)."""


#: The largest job id a store holds: ids are signed 64-bit integers in SQL, and every
#: store keeps to that range.
MAX_JOB_ID = 2**63 - 1


def possible_job_id(job_id: object) -> bool:
    """Whether ``job_id`` could name a job: a whole number from 1 to :data:`MAX_JOB_ID`.

    Any other id is no job's. Stores check it before a query, so that asking about such
    an id answers "no such job" (or acts on nothing) instead of failing in the driver:
    an integer past 64 bits overflows SQLite's and PostgreSQL's.
    """
    return isinstance(job_id, int) and not isinstance(job_id, bool) and 1 <= job_id <= MAX_JOB_ID


def possible_job_ids(job_ids: Sequence[int]) -> list[int]:
    """The ids of ``job_ids`` that :func:`possible_job_id` accepts, in their order."""
    return [j for j in job_ids if possible_job_id(j)]


class Store(Broker, Leases, Ledger):
    """A store that plays all three roles; see the module docstring for the contract."""

    capabilities: Capabilities = Capabilities()

    #: The schema versions before and after the last migration this store object
    #: applied (on open or by :meth:`migrate`); ``None``: it applied none, the schema was
    #: up to date (or the store has none). A first version of 0: there was no schema.
    migrated: tuple[int, int] | None = None

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and create or check the schema; raise a :class:`StoreError` on failure."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Safe to call twice."""

    @abc.abstractmethod
    async def migrate(self) -> int | None:
        """Create or upgrade the schema (works on an unopened store) and return its
        version; ``None`` for a store without one (in memory)."""


def _roles() -> dict[str, Role]:
    found: dict[str, Role] = {}
    for role, cls in ((Role.BROKER, Broker), (Role.LEASES, Leases), (Role.LEDGER, Ledger)):
        for name, value in vars(cls).items():
            if callable(value) and not name.startswith("_"):
                found[name] = role
    return found


#: The role of every public seam method, read from the class that declares it: what
#: the drill's per-role fault injection goes by.
ROLES: Mapping[str, Role] = _roles()
