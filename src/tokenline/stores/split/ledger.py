"""The PostgreSQL ledger of the split topology: business truth without the job rows.

In the split topology Redis holds the jobs and their leases; PostgreSQL holds the
effects, fences, duplicates and the user's business tables, and no job rows. Redis can
lose or reorder state (a failover to a replica that missed the last writes, a restart
without persistence), so the ledger cannot take the broker's word for who owns a job.
It keeps its own fence per job instead, ``job_fences``: the highest token it has
accepted for the job, with the owner that presented it, and whether the job's effect
has committed (``done_token``).

Why no effect is applied twice and no stale write is accepted, whatever Redis says:

1. Every ledger write that needs the job's token (a fenced transaction, an effect, a
   fence) starts its PostgreSQL transaction by advancing the job's fence
   (``fence_check`` / ``transaction_begin`` in ``queries.sql``): accepted only for a
   token above every token the ledger has accepted for the job, or the same token from
   the same owner. The row stays locked until commit, so two attempts of one job are
   serialised there and the second is judged against the first's committed outcome.
2. A fenced transaction ends with ``job_done`` in the same transaction as the user's
   writes: after it commits, every later attempt of the job — a redelivery after a lost
   ack, a zombie waking up — is refused at step 1, and the split store's claim hands
   such a job to nobody: it acknowledges it in Redis (the ledger answers DONE).
3. Tokens that Redis may hand out twice: a replica promoted after losing writes can
   issue a token number again. Each token carries an epoch
   (``epoch * 2**32 + counter``, see ``stores/redis/store.py``) that this ledger issues
   per Redis replication id (``epoch_for``); a promoted replica has a new replication id,
   so its tokens rise above every earlier one. And before the first script on the new
   server takes its epoch, an equal token from another owner is refused by step 1 all
   the same: the ledger never trusts a token number, only a (number, owner) it has not
   been shown by anyone else.
4. Job ids that Redis may hand out twice: the same promoted replica can issue again the
   id of a job it never heard of, which the ledger may hold as done; the new job would
   then be acknowledged unrun. A new epoch raises Redis's id sequence above every id of
   the epochs before (``epoch.lua``), and ids are drawn only under the epoch of the
   server at hand (``enqueue.lua`` checks it), so ``job_fences`` never sees two jobs
   under one id.

Retention keeps that promise: a job pruned from Redis keeps its ``job_fences`` row,
marked ``pruned_at`` (``fences_pruned``), which refuses every token; deleting it would
let the job's stale attempt create a fresh row and write (see ``retention.py``).

What Redis is still trusted for: telling a worker early that its lease is gone (the
split store checks the lease there before a ledger write, to avoid pointless work);
never for safety.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

from psycopg import AsyncConnection, AsyncCursor
from psycopg.rows import dict_row

from ..._errors import StoreCorruptError, StoreError
from ..._jobs import Finish, Lease
from ..._records import (
    Duplicate,
    DuplicateKind,
    EffectBegin,
    EffectRecord,
    EffectStatus,
    Fence,
    Start,
    by_attempt,
)
from .._repairs import ABANDONED, RERUN
from .._rows import effect_from_row
from .._sql import load_queries
from ..base import (
    Drift,
    FencedTransaction,
    Inconsistency,
    PruneKind,
    ResourceLease,
    leader_refused,
)
from ..postgres import PostgresStore
from ..postgres._deadline import run_bounded
from ..postgres._migrations import compose
from ..postgres._steps import AsyncDriver, Steps, fetch_one
from ..postgres._transaction import PostgresFencedTransaction

__all__ = ["SplitLedger"]

log = logging.getLogger("tokenline.store.split")
#: The split ledger's first objects (see split_core_present): all there, or none.
_CORE = frozenset({"job_fences", "redis_epochs", "redis_epoch_seq"})

_SPLIT_Q = load_queries(__name__.rpartition(".")[0])
#: The PostgreSQL store's query deleting a batch of each audit kind.
_AUDIT_PRUNE = {
    PruneKind.STALE_COMMITS: "prune_stale_commits",
    PruneKind.DUPLICATES: "prune_duplicates",
}

T = TypeVar("T")


class SplitLedger(PostgresStore):
    """The ledger role on PostgreSQL for jobs that live in another broker.

    Only its ledger methods (and :meth:`jobs_done`, :meth:`epoch_for`) are used: the
    split store takes the broker and leases roles from Redis.
    """

    #: The ledger's writes also record jobs done, fenced by their tokens, in job_fences.
    probed_tables: ClassVar[dict[str, tuple[tuple[str, ...], str]]] = {
        "ledger": (
            ("job_fences", "open_blocks", "effects", "fences"),
            "the ledger's writes (jobs done, effects, fences, fenced transactions)",
        ),
    }

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        #: A random id this ledger keeps for good, read by :meth:`open`: the split store
        #: records it in Redis, so that a second ledger on the same prefix is refused.
        self.identity: str | None = None
        for name, text in _SPLIT_Q.items():
            self._queries[name] = compose(text, self.schema)

    async def open(self) -> None:
        """Open the PostgreSQL store, then create the split tables if missing.

        Under the PostgreSQL store's migration lock, in one transaction, as its own
        migrations are: processes opening a new ledger at once create the tables once.
        ``CREATE TABLE IF NOT EXISTS`` alone does not serialise them, and all but the
        first would fail on the catalogue's unique index of type names.
        """
        await super().open()
        lock, create = self._q("migrate_lock"), self._q("split_schema")
        current, upgrade = self._q("split_schema_current"), self._q("split_schema_upgrade")
        take, identity = self._q("ledger_identity_take"), self._q("ledger_identity")
        core = self._q("split_core_present")

        async def run(conn: AsyncConnection[Any]) -> None:
            async with conn.transaction():
                await conn.execute(lock, {"schema": self.schema})
                cur = await conn.execute(core, {"schema": self.schema})
                present = {str(r[0]) for r in await cur.fetchall()}
                if present and present != _CORE:
                    lacks = ", ".join(sorted(_CORE - present))
                    raise StoreCorruptError(
                        f"the split ledger in schema {self.schema!r} of {self.target.where} "
                        f"is damaged: it lacks {lacks}. Made again empty, they would forget "
                        "which jobs are done and which tokens are stale; nothing was "
                        "changed: restore them from a backup"
                    )
                await conn.execute(create)
                cur = await conn.execute(current, {"schema": self.schema})
                row = await cur.fetchone()
                # Only when something is missing: the upgrade locks job_fences, and
                # would wait behind any ledger transaction holding a fence row.
                if row is None or not row[0]:
                    await conn.execute(upgrade)
                await conn.execute(take, {"id": secrets.token_hex(16), "now": self._now()})
                cur = await conn.execute(identity)
                row = await cur.fetchone()
                if row is None:  # taken just above, under the lock
                    raise StoreError(f"the ledger {self.target.where} has no identity")
                self.identity = str(row[0])

        await self._call(run)

    async def read_identity(self, *, opened: bool = True) -> str | None:
        """The ledger's identity, read without its set-up (for ``tokenline status``);
        None when it has none yet (no worker opened it since its tables were made, or
        its schema is not there). ``opened=False``: on a connection of its own, for a
        store not opened (``tokenline migrate``, before anything is created)."""
        present, identity = self._q("ledger_identity_present"), self._q("ledger_identity")

        async def run(conn: AsyncConnection[Any]) -> str | None:
            cur = await conn.execute(present, {"schema": self.schema})
            row = await cur.fetchone()
            if row is None or not row[0]:
                return None
            cur = await conn.execute(identity)
            row = await cur.fetchone()
            return None if row is None else str(row[0])

        if opened:
            return await self._call(run)

        async def once() -> str | None:
            conn = await AsyncConnection.connect(self.target.conninfo, autocommit=True)
            try:
                return await run(conn)
            finally:
                await conn.close()

        with self._translate():
            return await run_bounded(once(), self._deadline)

    def _finish_steps(self, finishes: Sequence[Finish]) -> Steps[list[bool]]:
        """Inside a fenced transaction: record the job done, fenced by its token (the
        broker's acknowledgement comes after the commit, from the worker)."""
        out = []
        for fin in finishes:
            lease = fin.lease
            params = {"job_id": lease.job_id, "token": lease.token, "owner": lease.owner}
            out.append((yield from fetch_one(self._q("job_done"), params)) is not None)
        return out

    def _complete_block_steps(self, finish: Finish) -> Steps[tuple[bool, bool]]:
        """Close the block's guard, then record the job done (two statements: the
        completion here is ``job_done``, not the jobs table's finish)."""
        block_open = (yield from fetch_one(self._q("transaction_block_close"))) is not None
        (accepted,) = yield from self._finish_steps([finish])
        return block_open, accepted

    def fenced_transaction(
        self, *, lease: Lease, fences: Sequence[Fence] = (), timeout: float | None = None
    ) -> FencedTransaction:
        """A fenced transaction whose commit records the job done in the ledger; the
        job is acknowledged in the broker afterwards (``committed`` stays false)."""
        return SplitFencedTransaction(self, lease, fences, timeout)

    def fences_steps(self, lease: Lease, fences: Sequence[Fence]) -> Steps[Fence | None]:
        """Advance each fence by the highest token of its issuer. The issuing resource
        lease lives in Redis: the split store checks it before the transaction (async
        forms); here, as everywhere, a lower token than the highest that wrote is
        refused."""
        for fence in fences:
            params = {
                "key": fence.key,
                "issuer": fence.issuer(lease.job_id),
                "token": fence.token,
                "job_id": lease.job_id,
                "owner": lease.owner,
                "now": self._now(),
            }
            if (yield from fetch_one(self._q("fence_advance"), params)) is None:
                return fence
        return None

    async def record_duplicate(self, dup: Duplicate) -> None:
        """Record ``dup`` for the audit, in a transaction of its own."""

        async def run(conn: AsyncConnection[Any]) -> None:
            await self.record_duplicate_on(conn, dup)

        await self._call(run)

    async def record_stale(self, lease: Lease, operation: str) -> None:
        """Record a refused write of ``lease`` as a stale commit, on its own."""

        async def run(conn: AsyncConnection[Any]) -> None:
            await AsyncDriver(conn).run(self._record_stale_steps(lease, operation))

        await self._call(run)

    async def effect_begin(self, *, lease: Lease, key: str) -> EffectBegin:
        """Take ``key`` for this attempt if allowed; see :meth:`Store.effect_begin`.

        As the PostgreSQL store's, except that a key pending under another job is
        judged by a statement of its own, after ``effect_take`` has locked the key row
        (see ``effect_take`` in ``queries.sql`` for why).
        """
        params = {
            "key": key,
            "job_id": lease.job_id,
            "token": lease.token,
            "owner": lease.owner,
            "now": self._now(),
            "rerun": RERUN,
            "abandoned": ABANDONED,
        }
        stale = by_attempt(key, DuplicateKind.STALE, "effect_begin", lease, 0.0)

        async def run(conn: AsyncConnection[Any]) -> EffectBegin:
            async with conn.transaction():
                if not await self._fence_check_on(conn, lease):
                    await self.record_duplicate_on(conn, stale)
                    return EffectBegin(Start.STALE, None)
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute(self._q("effect_take"), params)
                taken = await cur.fetchone()
                if taken is not None:
                    return EffectBegin(Start.RUN, effect_from_row(taken))
                await cur.execute(self._q("effect_get"), {"key": key})
                row = await cur.fetchone()
                if row is None:  # the row is locked by us: it cannot have gone
                    raise StoreError(f"effect {key!r} vanished under its lock")
                record: EffectRecord = effect_from_row(row)
                if record.status is EffectStatus.COMPLETED:
                    repeat = by_attempt(key, DuplicateKind.REPEAT, "effect", lease, 0.0)
                    await self.record_duplicate_on(conn, repeat)
                    return EffectBegin(Start.DONE, record)
                if record.job_id == lease.job_id:
                    if record.token > lease.token:
                        await self.record_duplicate_on(conn, stale)
                        return EffectBegin(Start.STALE, record)
                    return EffectBegin(Start.BUSY, record)
                owner = {"job_id": record.job_id, "token": record.token}
                await cur.execute(self._q("effect_owner_live"), owner)
                if await cur.fetchone() is None:
                    await cur.execute(self._q("effect_take_over"), params)
                    taken = await cur.fetchone()
                    if taken is not None:
                        return EffectBegin(Start.RUN, effect_from_row(taken))
                return EffectBegin(Start.BUSY, record)

        return await self._call(run)

    async def lease_lost(self, *, job_id: int, token: int, owner: str) -> bool:
        """Record that the broker has confirmed the lease of ``(job_id, token, owner)``
        lost; whether the ledger's fence of the job still carried that token."""
        params = {"job_id": job_id, "token": token, "owner": owner}
        return bool(await self._tuples(self._q("lease_lost"), params))

    async def jobs_done(self, *, job_ids: Sequence[int]) -> set[int]:
        """The jobs among ``job_ids`` whose fenced transaction has committed."""
        if not job_ids:
            return set()
        rows = await self._tuples(self._q("jobs_done"), {"job_ids": list(job_ids)})
        return {int(r[0]) for r in rows}

    async def pending_effects(self, *, deadline: float, limit: int) -> list[Inconsistency]:
        """Effect keys pending longer than ``deadline`` seconds, as ``EFFECT_PENDING``
        candidates: whether their attempt's lease is gone is for Redis to say."""
        p = {"now": self._now(), "deadline": deadline, "limit": limit}
        rows = await self._tuples(self._q("reconcile_pending_effects"), p)
        return [Inconsistency(Drift.EFFECT_PENDING, r[1], r[2], key=r[0], owner=r[3]) for r in rows]

    async def fences_unsettled(self, *, after: int, limit: int) -> list[Inconsistency]:
        """Up to ``limit`` jobs with an id above ``after`` that the ledger has seen, not
        completed, and not flagged lost: ``JOB_LOST`` candidates, for Redis to judge."""
        rows = await self._tuples(self._q("fences_unsettled"), {"after": after, "limit": limit})
        return [Inconsistency(Drift.JOB_LOST, r[0], r[1], owner=r[2]) for r in rows]

    async def reconcile_ledger(
        self, *, leader: ResourceLease, found: Sequence[Inconsistency]
    ) -> list[bool]:
        """The ledger's repairs (``EFFECT_PENDING``, ``JOB_LOST``) in one transaction
        fenced by ``leader``'s term (see :meth:`_leader_fenced`)."""

        async def repair(cur: AsyncCursor[Any]) -> list[bool]:
            return [await self._repair_on(cur, item) for item in found]

        return await self._leader_fenced(leader, "reconcile", repair)

    async def fences_pruned(self, *, leader: ResourceLease, job_ids: Sequence[int]) -> int:
        """Settle the fences of ``job_ids``, jobs retention deleted from the broker, in
        one transaction fenced by ``leader``'s term: they refuse every token from now
        on and leave the lost-job check (``fences_pruned`` in ``queries.sql`` says why
        they are kept). How many rows were settled."""
        params = {"job_ids": list(job_ids), "now": self._now()}

        async def settle(cur: AsyncCursor[Any]) -> int:
            await cur.execute(self._q("fences_pruned"), params)
            return cur.rowcount

        return await self._leader_fenced(leader, "prune", settle)

    async def prune_audit(
        self, *, leader: ResourceLease, kind: PruneKind, before: float, limit: int
    ) -> int:
        """Delete up to ``limit`` of the ledger's audit rows of ``kind`` (stale commits
        or duplicates) older than ``before``, fenced by ``leader``'s term."""
        query = self._q(_AUDIT_PRUNE[PruneKind(kind)])
        params = {"before": before, "limit": limit}

        async def prune(cur: AsyncCursor[Any]) -> int:
            await cur.execute(query, params)
            return cur.rowcount

        return await self._leader_fenced(leader, "prune", prune)

    async def fences_still_unsettled(self, *, job_ids: Sequence[int]) -> set[int]:
        """The jobs among ``job_ids`` not done, not flagged lost and not pruned."""
        if not job_ids:
            return set()
        rows = await self._tuples(self._q("fences_still_unsettled"), {"job_ids": list(job_ids)})
        return {int(r[0]) for r in rows}

    async def _leader_fenced(
        self,
        leader: ResourceLease,
        operation: str,
        write: Callable[[AsyncCursor[Any]], Awaitable[T]],
    ) -> T:
        """``write`` in one transaction that first advances the maintenance lease's own
        fence in the ledger to ``leader``'s term (``leader_fence``).

        The maintenance lease lives in Redis, which the split store asks first; this
        fence is what refuses a lower term here even if Redis has lost that lease (a
        failover, a restart): once a term has written to the ledger, no older term
        ever does again, nor the same term number from another owner
        (:class:`StaleTokenError`, nothing changed).
        """
        fence = Fence(leader.resource, leader.token, leader.resource, leader.owner)
        params = {
            "key": fence.key,
            "issuer": fence.issuer(0),
            "token": fence.token,
            "owner": leader.owner,
            "now": self._now(),
        }

        async def run(conn: AsyncConnection[Any]) -> T:
            cur = conn.cursor()
            async with conn.transaction():
                await cur.execute(self._q("leader_fence"), params)
                if await cur.fetchone() is None:
                    raise leader_refused(leader, operation)
                return await write(cur)

        return await self._call(run)

    async def _repair_on(self, cur: AsyncCursor[Any], item: Inconsistency) -> bool:
        p: dict[str, Any] = {
            "job_id": item.job_id,
            "token": item.token,
            "key": item.key,
            "owner": item.owner,
            "now": self._now(),
        }
        if item.kind is Drift.EFFECT_PENDING:
            await cur.execute(self._q("repair_effect_fail"), {**p, "error": ABANDONED})
            if cur.rowcount != 1:
                return False
            # The attempt that left it may write nothing more, whatever Redis says later.
            await cur.execute(self._q("lease_lost"), p)
            return True
        if item.kind is Drift.JOB_LOST:
            await cur.execute(self._q("job_flag_lost"), p)
            return cur.rowcount == 1
        raise ValueError(f"not a repair the ledger makes: {item.kind.value}")

    async def jobs_flagged_lost(self, *, limit: int = 100) -> list[tuple[int, float]]:
        """The jobs found gone from Redis (``job_lost_from_broker``), with when, newest
        first."""
        rows = await self._tuples(self._q("jobs_flagged_lost"), {"limit": limit})
        return [(int(job_id), float(at)) for job_id, at in rows]

    async def epoch_for(self, replid: str, prefix: str) -> int:
        """The fencing epoch of the Redis server with replication id ``replid`` (its
        identity), for the key prefix ``prefix``: a new id gets a number above every
        epoch issued before."""
        for _ in range(3):
            rows = await self._tuples(self._q("epoch_take"), {"replid": replid, "prefix": prefix})
            if rows:
                epoch, previous = int(rows[0][0]), rows[0][1]
                if previous is not None:
                    _identity_changed(str(previous), replid, epoch)
                return epoch
        raise StoreError(f"the ledger issued no epoch for Redis replication id {replid!r}")


def _identity_changed(previous: str, current: str, epoch: int) -> None:
    """Say, once (to the process that took the new epoch), that the broker's Redis is
    another server or lost its keys: what it held only in memory may be gone, and
    nothing else says so (queued jobs vanish without a trace)."""
    old_server, _, old_keys = previous.partition("/")
    new_server, _, new_keys = current.partition("/")
    if old_keys != new_keys:
        why = (
            "this prefix's keys were lost (FLUSHDB, keys deleted or evicted, or a server "
            "back without its data): the jobs it held are gone"
        )
    else:
        why = (
            f"its replication id changed ({old_server} to {new_server}): a failover or a "
            "restart, which loses the writes that had not reached the replica or the disk"
        )
    log.warning(
        "the broker's Redis has a new identity, fencing epoch %d: %s. Jobs the ledger had "
        "seen are reported by the reconciler (job_lost_from_broker); jobs enqueued and "
        "never run are not: enqueue them again if they must run",
        epoch,
        why,
    )


class SplitFencedTransaction(PostgresFencedTransaction):
    """A PostgreSQL fenced transaction that records the job done instead of finishing
    a job row: ``wrote`` is set on commit, ``committed`` is left false so the worker
    acknowledges the job in the broker."""

    def _complete(self) -> Steps[bool]:
        yield from super()._complete()
        return False
