"""The split topology: broker and leases on Redis, the ledger on PostgreSQL.

``App(broker="redis://…", leases="redis://…", ledger="postgresql://…")``. Each role
fails on its own: Redis can be slow, partitioned or fail over while PostgreSQL is fine,
and the other way round. The ledger (``ledger.py``) is what keeps the business data
safe when Redis has lost or reordered state; Redis only distributes the work and tells
a worker early that its lease is gone.

How a job's success travels: the fenced transaction commits the user's writes and the
job's completion record together in PostgreSQL, then the job is acknowledged in Redis
(by the transaction itself in the async form, else by the worker's finish). If that
acknowledgement is lost, Redis redelivers the job once its lease expires; the claim
asks the ledger first, and a job the ledger has completed is acknowledged and handed to
nobody: its effect does not run again.

Maintenance (``maintenance.py``): the reconciler's checks read one side and ask the
other — jobs Redis still holds that the ledger has completed, effects the ledger holds
pending whose lease Redis has let go, orphaned leases and open attempts in Redis, and
jobs the ledger has seen that Redis lost — each repair fenced by the leader's term on
the side it writes to. Retention (``retention.py``) prunes Redis and settles the
ledger's fences of the jobs it pruned, so that those are never taken for lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from ..._clock import Clock
from ..._errors import (
    ConfigError,
    JobNotFoundError,
    StaleTokenError,
    StoreError,
    StoreUnavailableError,
)
from ..._jobs import (
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
from ..._records import (
    Duplicate,
    DuplicateKind,
    EffectBegin,
    EffectRecord,
    Fence,
    Start,
    by_attempt,
)
from ..base import Capabilities, Depth, FencedTransaction, ResourceLease, Store
from ..postgres import PostgresStore
from ..redis import RedisStore
from .ledger import SplitLedger
from .maintenance import SplitMaintenance
from .retention import SplitRetention

__all__ = ["RolesUnavailableError", "SplitStore"]

log = logging.getLogger("tokenline.store.split")


class SplitStore(SplitMaintenance, SplitRetention, Store):
    """Broker and leases from a :class:`RedisStore`, the ledger from a
    :class:`SplitLedger` on PostgreSQL."""

    capabilities = Capabilities(
        multi_process=True,
        transactional_completion=True,
        ledger=True,
        ledger_waits_for_transaction=True,
        placeholder="%s",
        blocking_enqueue=True,
    )

    def __init__(
        self,
        *,
        broker: str,
        ledger: str,
        clock: Clock | None = None,
        timeout: float = 10.0,
        migrate: bool = True,
    ) -> None:
        #: The ledger role: business truth, the job fences and the Redis epochs.
        self.ledger = SplitLedger(ledger, clock=clock, timeout=timeout, migrate=migrate)
        #: The broker and leases roles; its tokens carry the ledger's epoch.
        self.redis = RedisStore(broker, clock=clock, timeout=timeout, epoch_source=self._epoch_for)
        self.clock = clock
        #: Jobs the claim found completed in the ledger and acknowledged in Redis.
        self.acknowledged_from_ledger = 0
        #: The roles the last :meth:`open` could not open, with their errors.
        self.roles_down: dict[str, Exception] = {}

    def channel_of(self, exc: BaseException, channel: str) -> str:
        """The role whose server failed: the ledger for PostgreSQL's errors, whatever
        the call (a claim asks the ledger too); for Redis's, the call's role, and the
        broker's for a ledger call (its job token check runs on Redis)."""
        server = getattr(exc, "server", None)
        if server == "PostgreSQL":
            return "ledger"
        if server == "Redis" and channel == "ledger":
            return "broker"
        return channel

    async def jobs_flagged_lost(self, *, limit: int = 100) -> list[tuple[int, float]]:
        """The jobs the reconciler found gone from Redis (``job_lost_from_broker``),
        with when (the ledger's clock), newest first: a worker's reconciler flags them
        once, and afterwards they are found only here (their Redis hash is gone)."""
        return await self.ledger.jobs_flagged_lost(limit=limit)

    async def open(self) -> None:
        """Open both sides, then take Redis's fencing epoch from the ledger.

        If a side cannot be opened, :class:`RolesUnavailableError` names the roles that
        failed (also kept in :attr:`roles_down`), and the side that did open is closed
        again: the store has no epoch then, so it must not be used for work, and a
        caller that gives up on it must not be left holding a connection pool whose
        tasks die with its event loop (``tokenline status`` probes each side with
        :meth:`open_within` instead).
        """
        failed: dict[str, StoreError] = {}
        try:
            await self.ledger.open()
        except StoreError as exc:
            failed["ledger"] = exc
        try:
            await self.redis.connect()
        except StoreError as exc:
            failed["broker"] = failed["leases"] = exc
        if not failed:
            try:
                await self._claim_prefix()
                await self.redis.refresh_epoch()
            except StoreError as exc:
                failed["broker"] = failed["leases"] = exc
            except ConfigError:
                with contextlib.suppress(StoreError):
                    await self.close()
                raise
        self.roles_down = {**failed}
        if failed:
            with contextlib.suppress(StoreError):
                await self.close()
            raise RolesUnavailableError(failed)

    async def _epoch_for(self, identity: str) -> int:
        """The ledger's epoch for Redis's ``identity``, the prefix claimed again for
        this ledger first. A new epoch is taken when the prefix's keys were lost (a
        Redis restarted without its data, a FLUSHDB), its ledger key with them: left
        unclaimed, the next process to open, with any ledger, took the prefix, and two
        ledgers then shared it, each blind to the other's writes. A prefix another
        ledger claimed meanwhile is refused (a :class:`~tokenline.StoreError` to every
        call of this process that needs the new epoch), as an open would refuse it."""
        mine = self.ledger.identity
        if mine is not None:
            self.redis.epoch_ledger = mine
            problem = await self._claim(mine)
            if problem is not None:
                raise StoreError(problem)
        return await self.ledger.epoch_for(identity, self.redis.prefix)

    async def _claim_prefix(self) -> None:
        """Record this ledger as the one the Redis prefix serves, or refuse a prefix
        another ledger serves. Two apps with their own ledgers on one prefix took each
        other's jobs, and each ledger, knowing nothing of the other's writes, issued
        the same epoch: a job paused past its lease ran again under the other app's
        ledger, its effect applied twice."""
        mine = self.ledger.identity
        if mine is None:  # the ledger was opened without its set-up
            return
        problem = await self._claim(mine)
        if problem is not None:
            raise ConfigError("ledger", problem)

    async def _claim(self, mine: str) -> str | None:
        """Record ledger ``mine`` as the prefix's unless another is recorded; what is
        wrong if another is (see :meth:`_served_by_another`)."""
        key = self.redis.prefix + "ledger"
        await self.redis._cmd("SET", key, f"{mine} {self._ledger_where()}", "NX")
        return self._served_by_another(mine, await self.redis._cmd("GET", key))

    def _ledger_where(self) -> str:
        return f"{self.ledger.target.where}, schema {self.ledger.schema!r}"

    def _served_by_another(self, mine: str, held: Any) -> str | None:
        """What is wrong when the prefix's ledger key (``held``, as Redis answered)
        names a ledger other than ``mine``, else None (also when the key is gone: the
        prefix's keys were lost, and the next open records it again)."""
        if isinstance(held, bytes):
            held = held.decode("utf-8", "replace")
        if held is None:
            return None
        theirs, _, their_where = str(held).partition(" ")
        if theirs == mine:
            return None
        where = self._ledger_where()
        if their_where == where:
            other = (
                "a ledger of the same name whose identity differs (its ledger_identity "
                "table was dropped or replaced, or the schema recreated)"
            )
        else:
            other = f"another ledger ({their_where or 'unnamed'})"
        key = self.redis.prefix + "ledger"
        return (
            f"the Redis prefix {self.redis.prefix!r} at {self.redis.where} already serves "
            f"{other}, not this one ({where}): apps with ledgers of their own need Redis "
            "prefixes of their own (?prefix=… in the broker URL). Only if this ledger "
            "replaces that one for good: stop every process that uses the other, then "
            f"delete the key {key!r}"
        )

    async def broker_write_probe(self, timeout: float) -> None:  # noqa: ASYNC109
        """For ``tokenline status``: the broker's Redis, as its own probe says, and,
        when the ledger answers, whether the prefix serves this ledger (a
        :class:`~tokenline.StoreError` if it serves another: every worker of this
        pair of URLs is refused at open). Writes nothing."""
        await self.redis.broker_write_probe(timeout)
        if "ledger" in self.roles_down:
            return
        mine = await self.ledger.read_identity()
        if mine is None:  # no identity yet: the first worker's open records it
            return
        problem = self._served_by_another(
            mine, await self.redis._cmd("GET", self.redis.prefix + "ledger")
        )
        if problem is not None:
            raise StoreError(problem)

    async def open_broker(self) -> None:
        """Open Redis alone, for an operator's command that reads or changes only what
        Redis keeps (queues and their pauses, jobs, workers, leases): it works while the
        ledger is down, which is when an operator most needs to pause a queue or drain
        a worker. No epoch is taken, so no token can be issued: a store opened this way
        cannot be used for work. :class:`RolesUnavailableError` if Redis cannot be
        reached."""
        try:
            await self.redis.connect()
        except StoreError as exc:
            self.roles_down = {"broker": exc, "leases": exc}
            raise RolesUnavailableError({"broker": exc, "leases": exc}) from exc
        self.roles_down = {}

    async def open_within(self, timeout: float, *, ledger: bool = True) -> None:  # noqa: ASYNC109
        """Open each side within ``timeout`` seconds, on its own, for ``tokenline
        status``: what failed is kept in :attr:`roles_down`, nothing is raised, and no
        epoch is taken (status issues no token; a script that needs one takes it).
        ``ledger=False`` leaves the ledger alone (its schema is missing: opening it
        would create it) and probes Redis only.

        The ledger is opened as a PostgreSQL store only (its schema checked), without
        the split tables' set-up of :meth:`SplitLedger.open`: its ``ALTER TABLE … ADD
        COLUMN IF NOT EXISTS`` takes the table's exclusive lock even when the column is
        there, so it waits for any transaction holding a job's fence (a paused worker's)
        — status would call a healthy ledger slow, and every fence check would queue
        behind it meanwhile. Status reads nothing of those tables.
        """

        async def side(opening: Any, server: str) -> Exception | None:
            try:
                async with asyncio.timeout(timeout):
                    await opening
            except TimeoutError:
                # A timeout, so that status calls the side slow rather than unreachable.
                return TimeoutError(f"{server} did not answer within {timeout:g}s")
            except StoreError as exc:
                return exc
            return None

        opening = [side(self.redis.connect(), self.server("broker"))]
        if ledger:
            opening.append(side(PostgresStore.open(self.ledger), self.server("ledger")))
        redis, *ledger_error = await asyncio.gather(*opening)
        self.roles_down = {}
        if ledger_error and ledger_error[0] is not None:
            self.roles_down["ledger"] = ledger_error[0]
        if redis is not None:
            self.roles_down["broker"] = self.roles_down["leases"] = redis

    def server(self, role: str) -> str:
        """The server that plays ``role``: ``Redis at …`` or ``PostgreSQL …``."""
        if role == "ledger":
            return f"PostgreSQL {self.ledger.target.where}"
        return f"Redis at {self.redis.where}"

    async def close(self) -> None:
        """Close both. Safe to call twice."""
        try:
            await self.redis.close()
        finally:
            await self.ledger.close()

    async def missing(self) -> str | None:
        """What is missing for this store to exist: the ledger's schema (Redis keeps no
        schema; a key prefix with no keys is an empty store)."""
        return await self.ledger.missing()

    async def unused(self) -> str | None:
        """The Redis note of :meth:`RedisStore.unused`."""
        return await self.redis.unused()

    async def migrate(self) -> int | None:
        """Migrate the ledger's schema (Redis has none). Refused, with nothing created
        or changed, when the Redis prefix already serves another ledger: every process
        of this pair of URLs would be refused at open (see :meth:`_claim_prefix`),
        while a migration said the store was ready. When Redis does not answer, the
        ledger is migrated unchecked, with a warning: the first open still refuses."""
        await self._refuse_prefix_of_another_ledger()
        version = await self.ledger.migrate()
        self.migrated = self.ledger.migrated
        return version

    async def _refuse_prefix_of_another_ledger(self) -> None:
        """For :meth:`migrate`: raise if the Redis prefix serves another ledger than
        this one, or than the one this ledger's first open will make."""
        connected_here = not self.redis.connected
        try:
            await self.redis.connect()
        except StoreError as exc:
            if connected_here:
                await self.redis.close()
            log.warning(
                "migrating the ledger without checking which ledger the Redis prefix "
                "%r serves (%s): the first worker's open will",
                *(self.redis.prefix, exc),
            )
            return
        try:
            held = await self.redis._cmd("GET", self.redis.prefix + "ledger")
        finally:
            if connected_here:
                await self.redis.close()
        if held is None:
            return
        # No identity yet: the ledger's first open makes a new one, which the prefix's
        # record cannot name.
        mine = await self.ledger.read_identity(opened=False)
        problem = self._served_by_another(mine or "", held)
        if problem is not None:
            raise ConfigError("ledger", problem)

    # -- broker: Redis, with the ledger's word on completed jobs --------------------------
    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        """Enqueue on Redis."""
        return await self.redis.jobs_enqueue(jobs=jobs, connection=connection)

    def jobs_enqueue_blocking(self, *, jobs: Sequence[NewJob]) -> list[int]:
        """Enqueue on Redis from the caller's thread."""
        return self.redis.jobs_enqueue_blocking(jobs=jobs)

    async def jobs_claim(
        self,
        *,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> list[ClaimedJob]:
        """Claim on Redis, then hand out only jobs the ledger has not completed: one it
        has (its acknowledgement was lost) is acknowledged now, under the new lease.

        If the ledger cannot answer, the claimed jobs are released (no attempt spent)
        and the error raised: a job is never run without the ledger's word. Nor within
        half the lease's ``ttl``: past it, a slow ledger would leave the leases to
        expire first, and the rescue would charge each job, never run, a lease expiry.
        """
        claimed = await self.redis.jobs_claim(
            owner=owner, queues=queues, limit=limit, ttl=ttl, priority_aging=priority_aging
        )
        if not claimed:
            return claimed
        try:
            try:
                async with asyncio.timeout(ttl / 2):
                    done = await self.ledger.jobs_done(job_ids=[c.job.id for c in claimed])
            except TimeoutError:
                late = StoreUnavailableError(
                    f"PostgreSQL {self.ledger.target.where} did not say within {ttl / 2:g}s "
                    "(half the lease) which claimed jobs it has completed"
                )
                late.server = "PostgreSQL"
                raise late from None
        except StoreError as exc:
            release = [
                Finish(c.lease, Outcome.RELEASE, 0.0, f"ledger unavailable: {exc}", "coordination")
                for c in claimed
            ]
            await self.redis.jobs_finish(finishes=release)
            raise
        if done:
            acks = [c.lease for c in claimed if c.job.id in done]
            acknowledged = sum(await self.redis.jobs_acknowledge_done(leases=acks))
            self.acknowledged_from_ledger += acknowledged
            # A repair: said and counted, never silent.
            log.warning(
                "acknowledged %d of jobs %s in Redis: the ledger had completed them (their "
                "acknowledgement was lost); they do not run again",
                acknowledged,
                sorted(done),
            )
        return [c for c in claimed if c.job.id not in done]

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        """Finish on Redis, each fenced by its token."""
        return await self.redis.jobs_finish(finishes=finishes)

    async def jobs_rescue(
        self, *, limit: int = 1000, leader: ResourceLease | None = None
    ) -> RescueReport:
        """Rescue expired leases on Redis (fenced there by ``leader``, whose lease
        Redis holds too), then end the ledger sessions those attempts left open: a
        paused or cut-off worker's fenced transaction would otherwise hold the job's
        ledger row, and its next attempt would wait for it until the session's own
        idle limit (up to the attempt's whole hard timeout)."""
        report = await self.redis.jobs_rescue(limit=limit, leader=leader)
        if report.attempts:
            await self.ledger.end_attempt_sessions(report.attempts)
        return report

    async def schedule_advance(
        self, *, leader: ResourceLease, schedule: str, instant: float, job: NewJob | None
    ) -> bool:
        """Move the schedule's mark and enqueue its job in one script on Redis, fenced
        by ``leader`` there (see :meth:`RedisStore.schedule_advance` for what a Redis
        failover does to marks, and why the ledger keeps the business effect once)."""
        return await self.redis.schedule_advance(
            leader=leader, schedule=schedule, instant=instant, job=job
        )

    async def schedule_marks(self) -> dict[str, float]:
        """The schedules' marks, from Redis."""
        return await self.redis.schedule_marks()

    async def queue_pause(self, *, queue: str) -> None:
        """Pause ``queue`` on Redis."""
        await self.redis.queue_pause(queue=queue)

    async def queue_resume(self, *, queue: str) -> None:
        """Resume ``queue`` on Redis."""
        await self.redis.queue_resume(queue=queue)

    async def queues_stats(self) -> list[QueueStats]:
        """Queue statistics from Redis."""
        return await self.redis.queues_stats()

    async def jobs_depth(self) -> list[Depth]:
        """Depth from Redis."""
        return await self.redis.jobs_depth()

    async def job_get(self, *, job_id: int) -> Job:
        """The job as Redis holds it."""
        return await self.redis.job_get(job_id=job_id)

    async def jobs_list(
        self,
        *,
        state: JobState | None = None,
        queue: str | None = None,
        limit: int = 100,
        args_limit: int | None = None,
    ) -> list[Job]:
        """Jobs from Redis."""
        return await self.redis.jobs_list(
            state=state, queue=queue, limit=limit, args_limit=args_limit
        )

    async def job_attempts(self, *, job_id: int) -> list[Attempt]:
        """Attempts from Redis."""
        return await self.redis.job_attempts(job_id=job_id)

    async def jobs_retry_dead(self, *, job_ids: Sequence[int]) -> int:
        """Retry dead jobs on Redis."""
        return await self.redis.jobs_retry_dead(job_ids=job_ids)

    async def jobs_cancel(self, *, job_ids: Sequence[int], reason: str) -> int:
        """Cancel jobs on Redis."""
        return await self.redis.jobs_cancel(job_ids=job_ids, reason=reason)

    async def stale_commits(self, *, limit: int = 100) -> tuple[int, list[StaleCommit]]:
        """Writes Redis refused for a stale token (finishes, renewals): the broker's.
        The fenced transactions the ledger refused are in :meth:`duplicates_list`."""
        return await self.redis.stale_commits(limit=limit)

    async def wait_for_jobs(self, *, queues: Sequence[str], timeout: float) -> None:  # noqa: ASYNC109
        """Poll (Redis notifications are not used)."""
        await self.redis.wait_for_jobs(queues=queues, timeout=timeout)

    # -- leases: Redis --------------------------------------------------------------------
    async def job_leases_renew(
        self, *, owner: str, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | None]:
        """Renew on Redis."""
        return await self.redis.job_leases_renew(owner=owner, leases=leases, ttl=ttl)

    async def store_time(self) -> float:
        """Redis's clock: the one every lease and schedule is measured by."""
        return await self.redis.store_time()

    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        """Register on Redis."""
        return await self.redis.worker_register(record=record, ttl=ttl)

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
        """Heartbeat on Redis."""
        return await self.redis.worker_heartbeat(
            worker_id=worker_id,
            token=token,
            state=state,
            in_flight=in_flight,
            ttl=ttl,
            skew=skew,
            concurrency_limit=concurrency_limit,
        )

    async def worker_deregister(self, *, worker_id: str, token: int) -> None:
        """Deregister on Redis."""
        await self.redis.worker_deregister(worker_id=worker_id, token=token)

    async def workers_list(self) -> list[WorkerRecord]:
        """Workers from Redis."""
        return await self.redis.workers_list()

    async def worker_drain(self, *, worker_id: str) -> bool:
        """Ask a worker to drain, on Redis."""
        return await self.redis.worker_drain(worker_id=worker_id)

    async def resource_lease_acquire(
        self, *, resource: str, owner: str, ttl: float
    ) -> ResourceLease | None:
        """Take a named lease on Redis."""
        return await self.redis.resource_lease_acquire(resource=resource, owner=owner, ttl=ttl)

    async def resource_lease_renew(
        self, *, lease: ResourceLease, ttl: float
    ) -> ResourceLease | None:
        """Renew a named lease on Redis."""
        return await self.redis.resource_lease_renew(lease=lease, ttl=ttl)

    async def resource_lease_release(self, *, lease: ResourceLease) -> bool:
        """Release a named lease on Redis."""
        return await self.redis.resource_lease_release(lease=lease)

    async def resource_leases_list(self) -> list[ResourceLease]:
        """Named leases from Redis."""
        return await self.redis.resource_leases_list()

    # -- ledger: PostgreSQL, after an early check on Redis --------------------------------
    async def _held(self, lease: Lease) -> bool:
        return await self.redis.job_lease_held(lease=lease)

    async def _refused(self, key: str, operation: str, lease: Lease) -> None:
        dup = by_attempt(key, DuplicateKind.STALE, operation, lease, 0.0)
        await self.ledger.record_duplicate(dup)

    async def _resources_held(self, lease: Lease, fences: Sequence[Fence]) -> bool:
        """Whether every resource lease issuing one of ``fences`` is still held on
        Redis; a refusal is recorded."""
        for fence in fences:
            if fence.resource is None or fence.owner is None:
                continue
            # The token a resource lease handed out carries this store's epoch.
            issued = ResourceLease(fence.resource, fence.owner, fence.token, 0.0)
            if not await self.redis.resource_lease_held(lease=issued):
                await self._refused(fence.key, "fence", lease)
                return False
        return True

    def _fence_refused(self, fence: Fence, lease: Lease) -> StaleTokenError:
        return StaleTokenError(
            resource=f"fence {fence.key!r}", token=fence.token, operation="transaction"
        )

    def fenced_transaction(
        self, *, lease: Lease, fences: Sequence[Fence] = (), timeout: float | None = None
    ) -> FencedTransaction:
        """The ledger's fenced transaction; the async form checks the lease (and the
        fences' resource leases) on Redis first and acknowledges the job there after
        the commit."""
        inner = self.ledger.fenced_transaction(lease=lease, fences=fences, timeout=timeout)
        return _SplitTransaction(self, lease, fences, inner)

    async def effect_begin(self, *, lease: Lease, key: str) -> EffectBegin:
        """Take ``key`` in the ledger, unless Redis already says the lease is gone."""
        if not await self._held(lease):
            await self._refused(key, "effect_begin", lease)
            current = await self.ledger.effects_list(key=key, limit=1)
            return EffectBegin(Start.STALE, current[0] if current else None)
        begin = await self.ledger.effect_begin(lease=lease, key=key)
        pending = begin.record
        if begin.start is Start.BUSY and pending is not None:
            # The ledger cannot see Redis's lease expiry: ask Redis whether the key's
            # owner still holds its job, and if not, say so to the ledger and try again.
            owner = Lease(pending.job_id, pending.owner, pending.token, 0.0)
            if not await self._held(owner):
                await self.ledger.lease_lost(
                    job_id=pending.job_id, token=pending.token, owner=pending.owner
                )
                begin = await self.ledger.effect_begin(lease=lease, key=key)
        return begin

    async def effect_finish(
        self, *, lease: Lease, key: str, result: str | None = None, error: str | None = None
    ) -> bool:
        """Record the effect's outcome in the ledger (fenced by the key's own token)."""
        return await self.ledger.effect_finish(lease=lease, key=key, result=result, error=error)

    async def effects_list(
        self, *, job_id: int | None = None, key: str | None = None, limit: int = 100
    ) -> list[EffectRecord]:
        """Effect records from the ledger."""
        return await self.ledger.effects_list(job_id=job_id, key=key, limit=limit)

    async def fence_write(self, *, lease: Lease, fence: Fence) -> bool:
        """Advance a fence in the ledger, unless Redis already says the lease is gone."""
        if not await self._held(lease):
            await self._refused(fence.key, "fence", lease)
            return False
        if not await self._resources_held(lease, [fence]):
            return False
        return await self.ledger.fence_write(lease=lease, fence=fence)

    async def duplicates_list(
        self, *, since: float | None = None, limit: int = 10_000
    ) -> list[Duplicate]:
        """The ledger's duplicates and Redis's refused commits, newest first."""
        found = await self.ledger.duplicates_list(since=since, limit=limit)
        _, stale = await self.redis.stale_commits(limit=limit)
        for s in stale:
            if since is not None and s.at < since:
                continue
            try:
                job = await self.redis.job_get(job_id=s.job_id)
                key = job.idempotency_key or f"job:{s.job_id}"
            except (StoreError, JobNotFoundError):
                # A job gone from Redis (pruned, its hash evicted or deleted, a flushed
                # database) still has its refused write in the audit.
                key = f"job:{s.job_id}"
            found.append(
                Duplicate(key, DuplicateKind.STALE, s.operation, s.job_id, s.token, s.owner, s.at)
            )
        renewals = await self.redis.resource_renewals_refused(limit=limit)
        found += [d for d in renewals if since is None or d.at >= since]
        return sorted(found, key=lambda d: -d.at)[:limit]


class RolesUnavailableError(StoreUnavailableError):
    """Some roles of a split store could not be opened; :attr:`failed` says which, each
    with its error (the message names Redis or PostgreSQL)."""

    def __init__(self, failed: dict[str, StoreError]) -> None:
        #: The error of each role that failed.
        self.failed = failed
        seen: list[str] = []
        for exc in failed.values():
            if str(exc) not in seen:
                seen.append(str(exc))
        super().__init__("; ".join(seen))


class _SplitTransaction(FencedTransaction):
    """The ledger's fenced transaction, with the Redis side around it (async form)."""

    def __init__(
        self, store: SplitStore, lease: Lease, fences: Sequence[Fence], inner: FencedTransaction
    ) -> None:
        self._store = store
        self._lease = lease
        self._fences = fences
        self._inner = inner

    def __enter__(self) -> Any:
        return self._inner.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._inner.__exit__(exc_type, exc, tb)
        finally:
            self.wrote = self._inner.wrote

    async def __aenter__(self) -> Any:
        if not await self._store._held(self._lease):
            await self._store.ledger.record_stale(self._lease, "transaction")
            raise StaleTokenError(
                resource=f"job {self._lease.job_id}",
                token=self._lease.token,
                operation="transaction",
            )
        for fence in self._fences:
            if not await self._store._resources_held(self._lease, [fence]):
                raise self._store._fence_refused(fence, self._lease)
        return await self._inner.__aenter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self._inner.__aexit__(exc_type, exc, tb)
        finally:
            self.wrote = self._inner.wrote
        if self.wrote and exc is None:
            # The ledger holds the completion; the acknowledgement is an optimisation
            # from here on: if it is lost, the next claim asks the ledger.
            try:
                (ok,) = await self._store.jobs_finish(
                    finishes=[Finish(self._lease, Outcome.SUCCEEDED)]
                )
            except StoreError:
                ok = False
            self.committed = ok
