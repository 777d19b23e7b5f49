"""The Redis store: broker and leases on Redis, every atomic step one Lua script.

``redis://host:port/db?prefix=name`` (``rediss://`` for TLS). All of a store's keys
start with ``{name}:`` (default ``tokenline``), one Redis Cluster hash slot; the few
connection options a URL may also carry are listed and checked in ``_url.py``. The
scripts in ``scripts/`` document, each in its header, the keys and arguments they use.

Why it is safe (DESIGN.md sections 3-4), piece by piece:

* **Fenced writes.** Renewal and every finish run as one script that compares the
  job's state, owner and token and then writes: Redis runs a script atomically, so no
  other client's write falls between the compare and the set.
* **Store time.** Lease expiries, ``run_at`` and timestamps come from the server's
  ``TIME`` inside the script; a worker's wall clock is never sent. (A store built with
  an explicit clock sends its ``now`` instead: tests only.)
* **Monotonic tokens.** Each claim and each rescue increments the job's counter. A
  token handed out is ``epoch * 2**32 + counter``; the epoch (see ``epoch.py``) comes
  from an epoch source, a ledger, and rises on every change of the Redis server's
  replication id, so a promoted replica that lost recent writes still hands out tokens
  above every token of the server it replaced. Without an epoch source the epoch is 0.
* **Rules in the core.** The next state of a finished or rescued job is computed by
  :func:`~tokenline._jobs.finish_transition` / :func:`~tokenline._jobs.rescue_transition`
  and only applied by the scripts.

Redis is not a durable store: a server without persistence loses everything when it
restarts, and a replica promoted after a failover may miss the last writes. Jobs are
then lost from the broker; the split topology's ledger keeps the business data safe
(it refuses a token it has already seen from another owner), not the queue itself.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any, cast

import redis
from redis import asyncio as aioredis
from redis.commands.core import AsyncScript, Script

from ..._clock import Clock
from ..._errors import (
    InvalidInputError,
    JobNotFoundError,
    NotSupportedError,
    StaleTokenError,
    StoreError,
    StoreUnavailableError,
    enqueue_outcome_unknown,
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
    RescueCandidate,
    RescueReport,
    StaleCommit,
    finish_transition,
    rescue_transition,
)
from ..base import (
    Broker,
    Capabilities,
    Depth,
    EventLoopNeeded,
    Leases,
    ResourceLease,
    possible_job_id,
    possible_job_ids,
)
from ._errors import map_redis_errors, maybe_sent
from ._url import parse_redis_url
from ._values import fl as _fl
from ._values import fmt as _f
from ._values import job_args as _job_args
from ._values import opt as _opt
from ._values import pairs as _pairs
from ._values import text as _s
from .maintenance import RedisMaintenance
from .membership import RedisMembership
from .retention import RedisRetention

__all__ = ["LEDGER_DONE", "EpochSource", "RedisStore"]

log = logging.getLogger("tokenline.store.redis")
#: The memory problems already logged by this process (see RedisStore.connect).
_MEMORY_WARNED: set[str] = set()

#: Where a store gets its fencing epoch: called with the Redis server's replication id,
#: it returns the epoch for that server (a new, higher one for an id it has not seen).
EpochSource = Callable[[str], Awaitable[int]]

_SCRIPTS = (
    "enqueue",
    "epoch",
    "claim",
    "renew",
    "finish",
    "rescue_scan",
    "rescue_apply",
    "operator",
    "inspect",
    "worker",
    "resource",
    "held",
    "reconcile_scan",
    "reconcile_apply",
    "schedule",
    "prune",
    "prune_fill",
    "prune_audit",
)
#: The outcome recorded for an attempt that found its job completed in the ledger.
LEDGER_DONE = "ledger_done"
#: Tokens are ``epoch * 2**32 + counter``.
EPOCH_SHIFT = 32
_EPOCH_ERROR = "TLEPOCH"
#: Tries at recording a new epoch while the server's keys keep vanishing.
_EPOCH_TRIES = 3
#: Most jobs one enqueue takes. A batch goes in by one script, all or nothing, and a
#: script runs alone on the server: every other client, workers renewing their leases
#: included, waits until it ends, and past 5 seconds (``busy-reply-threshold``) gets
#: ``BUSY`` instead. 10,000 jobs take a few tenths of a second.
MAX_BATCH = 10_000
#: The error rescue_apply.lua raises when the caller is no longer the leader.
_LEADER_ERROR = "TLLEADER"


def _load_scripts() -> dict[str, str]:
    folder = resources.files(__package__).joinpath("scripts")
    lib = folder.joinpath("_lib.lua").read_text(encoding="utf-8")
    return {
        name: lib + "\n" + folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
        for name in _SCRIPTS
    }


_TEXT = _load_scripts()


class RedisStore(RedisMembership, RedisMaintenance, RedisRetention, Broker, Leases):
    """Broker and leases on one Redis server (or primary); plays no ledger."""

    capabilities = Capabilities(multi_process=True, ledger=False, blocking_enqueue=True)

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        timeout: float = 10.0,
        epoch_source: EpochSource | None = None,
    ) -> None:
        self.url = url
        self._target = parse_redis_url(url)
        #: ``{name}:``, the start of every key of the store.
        self.prefix = self._target.prefix
        #: ``host:port/db``, naming the server in messages (never the password).
        self.where = self._target.where
        self.clock = clock
        self.timeout = timeout
        self._epoch_source = epoch_source
        #: The fencing epoch this store's tokens carry (0 without an epoch source).
        self.epoch = 0
        #: The id of the ledger that issues the epochs (the split store sets it): the
        #: scripts check it with the epoch, whose numbers each ledger counts alone.
        self.epoch_ledger = ""
        self._epoch_taken = epoch_source is None
        self._client: aioredis.Redis | None = None
        self._scripts: dict[str, AsyncScript] = {}
        # Single enqueues from synchronous code go on the caller's thread through a
        # blocking client of their own (thread-safe pool), made on first use.
        self._sync_client: redis.Redis | None = None
        self._sync_enqueue: Script | None = None
        self._sync_lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect, check the server answers, and take the fencing epoch."""
        await self.connect()
        if self._epoch_source is not None:
            await self.refresh_epoch()

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` made a client that :meth:`close` has not closed."""
        return self._client is not None

    async def connect(self) -> None:
        """Connect and check the server answers, without taking an epoch: until one is
        taken, every script that issues or checks a token takes it first.

        Opening an open store keeps its client: a second one would replace the first
        and leave its connections open, with nobody left to close them."""
        if self._client is None:
            client = aioredis.Redis.from_url(self._target.connect, **self._client_options())
            self._client = client
            self._scripts = {name: client.register_script(t) for name, t in _TEXT.items()}
        await self._cmd("PING")
        problem = await self.memory_problem()
        if problem is not None and problem not in _MEMORY_WARNED:
            _MEMORY_WARNED.add(problem)  # once per process: every command connects
            log.warning("%s", problem)

    async def memory_problem(self) -> str | None:
        """What the server's memory settings do to tokenline's keys, or ``None``: a
        ``maxmemory`` with an evicting ``maxmemory-policy`` deletes job hashes, queues
        and leases under pressure (a whole queue stalled behind its evicted index,
        seen); with ``noeviction``, a server at its ``maxmemory`` refuses every write
        (enqueues, claims, renewals) while reads answer. ``None`` too when the server
        does not say (INFO refused)."""
        try:
            info = await self._cmd("INFO", "memory")
        except StoreUnavailableError:
            raise
        except StoreError:
            return None
        if not isinstance(info, dict):
            return None
        limit = int(info.get("maxmemory") or 0)
        policy = info.get("maxmemory_policy", "noeviction")
        if isinstance(policy, bytes):
            policy = policy.decode("ascii", "replace")
        if not limit:
            return None  # no limit: the policy never applies
        if policy != "noeviction":
            return (
                f"Redis at {self.where} evicts keys under memory pressure "
                f"(maxmemory {limit} bytes, maxmemory-policy {policy}): it can delete job "
                "hashes, queue indexes and leases, and jobs with them; run tokenline's "
                "Redis with maxmemory-policy noeviction"
            )
        used = int(info.get("used_memory") or 0)
        if used >= limit:
            return (
                f"Redis at {self.where} is full (used {used} of maxmemory {limit} bytes, "
                "maxmemory-policy noeviction): it refuses every write (enqueues, claims, "
                "lease renewals) until memory is freed or maxmemory raised"
            )
        return None

    async def broker_write_probe(self, timeout: float) -> None:  # noqa: ASYNC109
        """For ``tokenline status``: raise :class:`~tokenline.StoreError` when the
        server's memory settings refuse or lose the broker's writes (see
        :meth:`memory_problem`), though every read answers. ``timeout``: unused, each
        command has the store's own."""
        problem = await self.memory_problem()
        if problem is not None:
            raise StoreError(problem)

    def _client_options(self) -> dict[str, Any]:
        """redis-py's keyword arguments for a client: the store's timeout, then the
        options of the URL, already checked, which win."""
        return {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "decode_responses": False,
            **self._target.options,
        }

    async def close(self) -> None:
        """Release the connection pool. Safe to call twice."""
        client, self._client = self._client, None
        with self._sync_lock:
            sync_client, self._sync_client, self._sync_enqueue = self._sync_client, None, None
        if sync_client is not None:
            sync_client.close()
        if client is not None:
            await client.aclose()

    async def migrate(self) -> None:
        """Nothing to migrate: the Redis store has no schema."""

    async def unused(self) -> str | None:
        """A note for an operator's command when no tokenline store was ever used under
        this prefix (its id sequence is not there): a prefix with no keys is an empty
        store, and a mistyped one would otherwise show as a healthy, empty queue.
        ``None`` when one was, or when the server refuses the question (the command's
        own call says why). Needs no open client.

        Raises :class:`~tokenline.StoreUnavailableError` when the server does not answer
        within the store timeout: opening it next would wait as long again to say so."""
        client = aioredis.Redis.from_url(self._target.connect, **self._client_options())
        try:
            with map_redis_errors(self.where, "EXISTS"):
                found = await client.exists(self.prefix + "seq")
        except StoreUnavailableError:
            raise
        except StoreError:
            return None
        finally:
            await client.aclose()
        if found:
            return None
        return (
            f"Redis at {self.where} holds no tokenline keys under the prefix "
            f"{self.prefix!r}: a store not used yet, a mistyped prefix, or keys lost "
            "(`tokenline reconcile` rebuilds what the ledger knows)"
        )

    def _redis(self) -> aioredis.Redis:
        if self._client is None:
            raise StoreError("the Redis store is not open; call open() first")
        return self._client

    def _now(self) -> str:
        return "" if self.clock is None else _f(self.clock.now())

    def _epoch_arg(self) -> str:
        if self._epoch_source is None:
            return ""
        return f"{self.epoch}/{self.epoch_ledger}" if self.epoch_ledger else str(self.epoch)

    async def replication_id(self) -> str:
        """The server's replication id: it changes when a replica is promoted or the
        server restarts, the two ways Redis can forget tokens it handed out."""
        info = await self._cmd("INFO", "replication")
        if isinstance(info, dict) and "master_replid" in info:
            return str(info["master_replid"])
        raise StoreError(f"Redis at {self.where} reports no replication id")

    async def server_identity(self) -> str:
        """What an epoch is issued for: the server's replication id and this prefix's
        incarnation, a random value set here when there is none. Any loss of the
        prefix's keys (a FLUSHDB, keys deleted, a server back without its data) takes the
        incarnation too, so the next identity is new and gets a new, higher epoch."""
        key = self.prefix + "incarnation"
        await self._cmd("SET", key, secrets.token_hex(8), "NX")
        incarnation = await self._cmd("GET", key)
        if isinstance(incarnation, bytes):
            incarnation = incarnation.decode("ascii", "replace")
        return f"{await self.replication_id()}/{incarnation or ''}"

    async def refresh_epoch(self) -> int:
        """Take the epoch for the server's identity (:meth:`server_identity`) from the
        epoch source and record both in Redis, so the scripts know which server, and
        which incarnation of its keys, it was issued for."""
        if self._epoch_source is None:
            return 0
        for tries_left in reversed(range(_EPOCH_TRIES)):
            identity = await self.server_identity()
            epoch = await self._epoch_source(identity)
            try:
                await self._eval("epoch", [epoch, identity, self.epoch_ledger])
                break
            except StoreError as exc:
                # The keys were lost again between the read and the record.
                if _EPOCH_ERROR not in str(exc) or not tries_left:
                    raise
        self.epoch = epoch
        self._epoch_taken = True
        return epoch

    async def _run(self, name: str, args: Sequence[Any]) -> Any:
        """Run script ``name``; on a changed server (TLEPOCH) take a new epoch and run
        it once more with that epoch in place of the old one."""
        if not self._epoch_taken and _epoch_slot(name) >= 0:
            # Opened without an epoch (the epoch source was unreachable): no token is
            # issued or checked before one is taken.
            await self.refresh_epoch()
            args = [self._epoch_arg() if i == _epoch_slot(name) else a for i, a in enumerate(args)]
        epoch_before = self._epoch_arg()
        try:
            return await self._eval(name, args)
        except StoreError as exc:
            if _EPOCH_ERROR not in str(exc) or self._epoch_source is None:
                raise
        await self.refresh_epoch()
        fresh = [
            self._epoch_arg() if a == epoch_before and i == _epoch_slot(name) else a
            for i, a in enumerate(args)
        ]
        return await self._eval(name, fresh)

    async def _cmd(self, *args: Any) -> Any:
        """One Redis command (atomic on its own), errors translated."""
        client = self._redis()
        with map_redis_errors(self.where, str(args[0])):
            return await cast(Awaitable[Any], client.execute_command(*args))  # type: ignore[no-untyped-call]

    async def _hashes(self, keys: Sequence[str]) -> list[Any]:
        """HGETALL of each key, in one round trip."""
        client = self._redis()
        with map_redis_errors(self.where, "HGETALL"):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.execute_command("HGETALL", key)
            return list(await pipe.execute())

    async def _eval(self, name: str, args: Sequence[Any]) -> Any:
        with map_redis_errors(self.where, f"script {name}.lua"):
            return await self._scripts[name](keys=[self.prefix], args=list(args))

    def _token(self, counter: Any) -> int:
        return (self.epoch << EPOCH_SHIFT) + int(counter)

    def _job(self, flat: Any) -> Job:
        """The job a hash holds; :class:`_BadHash` for a field missing or unreadable."""
        h = _pairs(flat)
        try:
            return self._parse_job(h)
        except (KeyError, ValueError) as exc:
            raise _BadHash(f"{type(exc).__name__}: {exc}") from None

    def _parse_job(self, h: dict[str, str]) -> Job:
        return Job(
            id=int(h["id"]),
            queue=h["queue"],
            task=h["task"],
            args=h["args"],
            idempotency_key=h.get("idempotency_key"),
            priority=int(h["priority"]),
            run_at=float(h["run_at"]),
            attempt=int(h["attempt"]),
            max_attempts=int(h["max_attempts"]),
            state=JobState(h["state"]),
            lease_owner=h.get("lease_owner"),
            lease_token=self._token(h["lease_token"]),
            lease_expires_at=_fl(h.get("lease_expires_at")),
            last_error=h.get("last_error"),
            error_class=h.get("error_class"),
            created_at=float(h["created_at"]),
            updated_at=float(h["updated_at"]),
            finished_at=_fl(h.get("finished_at")),
            timeout=_fl(h.get("timeout")),
            lease_expiries=int(h["lease_expiries"]),
            max_lease_expiries=int(h["max_lease_expiries"]),
        )

    # -- broker ---------------------------------------------------------------------------
    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        """Insert all ``jobs`` in one script and return their ids."""
        if connection is not None:
            raise NotSupportedError("the Redis store cannot enqueue inside a database transaction")
        if not jobs:
            return []
        args = self._enqueue_args(jobs)
        try:
            return [int(i) for i in await self._run("enqueue", args)]
        except StoreUnavailableError as exc:
            if maybe_sent(exc):
                raise enqueue_outcome_unknown(exc, len(jobs)) from exc
            raise

    def jobs_enqueue_blocking(self, *, jobs: Sequence[NewJob]) -> list[int]:
        """:meth:`jobs_enqueue` in the caller's thread, on a blocking client of this
        store's own: the same script, so the same ids, states and unique answers."""
        if not jobs:
            return []
        if not self._epoch_taken:
            raise EventLoopNeeded("the store takes its fencing epoch first")
        args = self._enqueue_args(jobs)
        script = self._blocking_enqueue_script()
        try:
            with map_redis_errors(self.where, "script enqueue.lua"):
                return [int(i) for i in script(keys=[self.prefix], args=args)]
        except StoreUnavailableError as exc:
            if maybe_sent(exc):
                raise enqueue_outcome_unknown(exc, len(jobs)) from exc
            raise
        except StoreError as exc:
            if _EPOCH_ERROR in str(exc):
                # Another server (a promoted replica): its epoch is taken on the loop.
                raise EventLoopNeeded(str(exc)) from None
            raise

    def _blocking_enqueue_script(self) -> Script:
        with self._sync_lock:
            if self._client is None:
                raise StoreError("the Redis store is not open; call open() first")
            if self._sync_enqueue is None:
                client = redis.Redis.from_url(self._target.connect, **self._client_options())
                self._sync_client = client
                self._sync_enqueue = client.register_script(_TEXT["enqueue"])
            return self._sync_enqueue

    def _enqueue_args(self, jobs: Sequence[NewJob]) -> list[Any]:
        """The enqueue script's arguments for ``jobs``; a batch over :data:`MAX_BATCH`
        is refused before anything is sent."""
        if len(jobs) > MAX_BATCH:
            raise InvalidInputError(
                f"a batch of {len(jobs):,} jobs is over the Redis store's limit of "
                f"{MAX_BATCH:,}: one batch is one script, which holds up every other "
                f"client of the server while it runs; enqueue at most {MAX_BATCH:,} "
                "jobs at a time (each batch all or nothing)"
            )
        args: list[Any] = [self._now(), self._epoch_arg(), len(jobs)]
        for j in jobs:
            args += _job_args(j)
        return args

    async def jobs_claim(
        self,
        *,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> list[ClaimedJob]:
        """Lease the best ready jobs to ``owner`` in one script."""
        if limit <= 0 or not queues:
            return []
        aging = "" if priority_aging is None else _f(priority_aging)
        out = await self._run(
            "claim", [self._now(), owner, limit, _f(ttl), aging, self._epoch_arg(), *queues]
        )
        self._log_dropped(out[1])
        claimed = []
        for flat in out[2:]:
            try:
                job = self._job(flat)
            except _BadHash as exc:
                # claim.lua checks every field first, so this is a hash it reads
                # differently: the job expires like any lost claim, the others run.
                jid = _pairs(flat).get("id", "?")
                log.warning("claimed job hash %sjob:%s is unreadable: %s", self.prefix, jid, exc)
                continue
            lease = Lease(job.id, owner, job.lease_token, job.lease_expires_at or 0.0)
            claimed.append(ClaimedJob(job, lease))
        return claimed

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        """Apply every finish in one script, each conditional on its token."""
        return await self._finish(finishes)

    async def jobs_acknowledge_done(self, *, leases: Sequence[Lease]) -> list[bool]:
        """Mark succeeded the jobs a ledger has already completed under an earlier
        attempt, each conditional on its current token. The attempt holding the lease
        ran nothing: it is recorded with the outcome :data:`LEDGER_DONE`, not
        ``succeeded``, so the history still says which attempt did the work."""
        finishes = [Finish(lease, Outcome.SUCCEEDED) for lease in leases]
        return await self._finish(finishes, LEDGER_DONE)

    async def _finish(self, finishes: Sequence[Finish], label: str | None = None) -> list[bool]:
        if not finishes:
            return []
        args: list[Any] = [self._now(), self._epoch_arg(), len(finishes)]
        for fin in finishes:
            move = finish_transition(fin)
            args += [
                fin.lease.job_id,
                fin.lease.owner,
                fin.lease.token,
                label or fin.outcome.value,
                move.state.value,
                "" if move.delay is None else _f(move.delay),
                move.refund,
                1 if move.finished else 0,
                _opt(fin.error),
                _opt(fin.error_class),
            ]
        return [bool(int(x)) for x in await self._run("finish", args)]

    async def jobs_rescue(
        self, *, limit: int = 1000, leader: ResourceLease | None = None
    ) -> RescueReport:
        """Requeue or dead-letter running jobs whose lease expired by Redis's clock;
        with ``leader``, only while it holds the maintenance lease (checked in the
        script that moves them, else :class:`StaleTokenError`, nothing changed)."""
        scan = await self._run("rescue_scan", [self._now(), limit])
        self._log_dropped(scan[1])
        rows = [[_s(v) for v in scan[i : i + 7]] for i in range(2, len(scan), 7)]
        fence = ["", "", ""] if leader is None else [leader.resource, leader.owner, leader.token]
        args: list[Any] = [self._now(), self._epoch_arg(), *fence]
        moves = []
        for jid, token, owner, attempt, max_att, expiries, max_exp in rows:
            try:
                candidate = RescueCandidate(
                    int(jid),
                    int(token),
                    owner or None,
                    int(attempt),
                    int(max_att),
                    int(expiries),
                    int(max_exp),
                )
            except ValueError as exc:
                # One unreadable job must not stop the rescue of every other.
                log.warning("rescue skips job hash %sjob:%s: %s", self.prefix, jid, exc)
                continue
            rescue = rescue_transition(candidate)
            moves.append((int(jid), int(token), rescue.transition.state))
            args += [
                jid,
                token,
                rescue.transition.state.value,
                rescue.transition.refund,
                rescue.reason,
            ]
        if not moves:
            return RescueReport()
        try:
            done = await self._run("rescue_apply", args)
        except StoreError as exc:
            if leader is None or _LEADER_ERROR not in str(exc):
                raise
            raise StaleTokenError(
                resource=leader.resource, token=leader.token, operation="rescue"
            ) from None
        moved = [
            (jid, token, st) for (jid, token, st), ok in zip(moves, done, strict=True) if int(ok)
        ]
        return RescueReport(
            requeued=[jid for jid, _, st in moved if st is not JobState.DEAD],
            dead=[jid for jid, _, st in moved if st is JobState.DEAD],
            attempts=[(jid, token) for jid, token, _ in moved],
        )

    async def queue_pause(self, *, queue: str) -> None:
        """Pause ``queue`` (one SADD: atomic on its own)."""
        await self._cmd("SADD", self.prefix + "paused", queue)

    async def queue_resume(self, *, queue: str) -> None:
        """Resume ``queue`` (one SREM)."""
        await self._cmd("SREM", self.prefix + "paused", queue)

    async def queues_stats(self) -> list[QueueStats]:
        """Per-queue counts and oldest ready age, in one script."""
        out = await self._run("inspect", [self._now(), "stats"])
        now = float(out[0])
        stats = []
        for i in range(1, len(out), 4):
            name, paused, counts, oldest = out[i : i + 4]
            c = {k: int(v) for k, v in _pairs(counts).items() if int(v) > 0}
            first = _fl(_s(oldest))
            age = None if first is None else max(0.0, now - first)
            stats.append(QueueStats(_s(name), c, age, bool(int(paused))))
        return sorted(stats, key=lambda s: s.queue)

    async def jobs_depth(self) -> list[Depth]:
        """Unfinished jobs per queue, task and state, in one script."""
        out = await self._run("inspect", [self._now(), "depth"])
        found = []
        for i in range(1, len(out), 4):
            queue, _, task = _s(out[i]).partition("\t")
            for state, n in zip(
                ("queued", "scheduled", "running"), out[i + 1 : i + 4], strict=True
            ):
                if int(n) > 0:
                    found.append(Depth(queue, task, state, int(n)))
        return sorted(found, key=lambda d: (d.queue, d.task, d.state))

    async def job_get(self, *, job_id: int) -> Job:
        """The job, or :class:`JobNotFoundError`."""
        if not possible_job_id(job_id):
            raise JobNotFoundError(f"no job with id {job_id}")
        flat = await self._cmd("HGETALL", f"{self.prefix}job:{job_id}")
        if not flat:
            raise JobNotFoundError(f"no job with id {job_id}")
        try:
            return self._job(flat)
        except _BadHash as exc:
            raise JobNotFoundError(
                f"job {job_id}'s hash {self.prefix}job:{job_id} is malformed ({exc})"
            ) from None

    async def jobs_list(
        self,
        *,
        state: JobState | None = None,
        queue: str | None = None,
        limit: int = 100,
        args_limit: int | None = None,
    ) -> list[Job]:
        """Jobs filtered by state and queue, newest first (``args`` cut to ``args_limit``)."""
        cut = "" if args_limit is None else args_limit
        out = await self._run(
            "inspect",
            [self._now(), "list", "" if state is None else state.value, queue or "", limit, cut],
        )
        jobs = []
        for i in range(1, len(out), 2):
            jid, flat = _s(out[i]), out[i + 1]
            if not flat:
                log.warning(
                    "listing skips job %s: its hash %sjob:%s is missing", jid, self.prefix, jid
                )
                continue
            try:
                jobs.append(self._job(flat))
            except _BadHash as exc:
                log.warning(
                    "listing skips job %s: its hash %sjob:%s is malformed (%s)",
                    jid,
                    self.prefix,
                    jid,
                    exc,
                )
        return jobs

    def _log_dropped(self, dropped: Any) -> None:
        """Warn of each job a script took out of every index (pairs of id and key)."""
        for i in range(0, len(dropped), 2):
            jid, key = _s(dropped[i]), _s(dropped[i + 1])
            if key.endswith(f"job:{jid}"):
                why = f"its hash {key} is missing"
            else:
                why = f"its hash was malformed, moved to {key}"
            log.warning("job %s dropped from every queue and index, it cannot run: %s", jid, why)

    async def job_attempts(self, *, job_id: int) -> list[Attempt]:
        """Attempts of the job, oldest first."""
        if not possible_job_id(job_id):
            raise JobNotFoundError(f"no job with id {job_id}")
        exists = await self._cmd("EXISTS", f"{self.prefix}job:{job_id}")
        items = await self._cmd("LRANGE", f"{self.prefix}attempts:{job_id}", 0, -1)
        if not exists:
            raise JobNotFoundError(f"no job with id {job_id}")
        out = []
        for raw in items:
            a = json.loads(raw)
            out.append(
                Attempt(
                    job_id,
                    int(a["attempt"]),
                    int(a["token"]),
                    a["owner"],
                    float(a["started_at"]),
                    _fl(a["finished_at"]),
                    a["outcome"],
                    a["error"],
                    a["error_class"],
                )
            )
        return out

    async def jobs_retry_dead(self, *, job_ids: Sequence[int]) -> int:
        """Requeue dead jobs with a fresh budget, in one script."""
        job_ids = possible_job_ids(job_ids)
        if not job_ids:
            return 0
        return int(await self._run("operator", [self._now(), "retry_dead", "", *job_ids]))

    async def jobs_cancel(self, *, job_ids: Sequence[int], reason: str) -> int:
        """Cancel queued, scheduled or dead jobs, in one script."""
        job_ids = possible_job_ids(job_ids)
        if not job_ids:
            return 0
        return int(await self._run("operator", [self._now(), "cancel", reason, *job_ids]))

    async def stale_commits(self, *, limit: int = 100) -> tuple[int, list[StaleCommit]]:
        """Total refused writes and the most recent ``limit``."""
        total = await self._cmd("GET", self.prefix + "stale_n")
        items = await self._cmd("LRANGE", self.prefix + "stale", 0, limit - 1) if limit > 0 else []
        recent = []
        for raw in items:
            s = json.loads(raw)
            recent.append(
                StaleCommit(
                    int(s["job_id"]), int(s["token"]), s["owner"], s["operation"], float(s["at"])
                )
            )
        return int(total or 0), recent

    # -- leases ---------------------------------------------------------------------------
    async def job_leases_renew(
        self, *, owner: str, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | None]:
        """Extend every held lease in one script."""
        if not leases:
            return []
        args: list[Any] = [self._now(), owner, _f(ttl), self._epoch_arg()]
        for lease in leases:
            args += [lease.job_id, lease.token, lease.owner]
        out = await self._run("renew", args)
        return [
            None if not _s(exp) else replace(lease, expires_at=float(exp))
            for lease, exp in zip(leases, out[1:], strict=True)
        ]

    async def job_lease_held(self, *, lease: Lease) -> bool:
        """Whether ``lease`` still holds its job (read only; an early check, not a
        guarantee: the lease may be lost a moment later)."""
        args = [self._now(), self._epoch_arg(), lease.job_id, lease.token, lease.owner]
        return bool(int(await self._run("held", args)))

    async def store_time(self) -> float:
        """Redis's clock (``TIME``), or the injected one."""
        if self.clock is not None:
            return self.clock.now()
        sec, usec = await self._cmd("TIME")
        return int(sec) + int(usec) / 1_000_000


class _BadHash(ValueError):
    """A job hash with a field missing or not as the scripts write it."""


def _epoch_slot(name: str) -> int:
    """Where script ``name`` takes the epoch among its arguments (-1: it does not)."""
    slots = {
        "enqueue": 1,
        "claim": 5,
        "renew": 3,
        "finish": 1,
        "resource": 3,
        "held": 1,
        "rescue_apply": 1,
        "reconcile_scan": 1,
        "reconcile_apply": 1,
        "schedule": 1,
        "prune": 1,
        "prune_fill": 1,
        "prune_audit": 1,
    }
    return slots.get(name, -1)
