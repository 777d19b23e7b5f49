"""SQLite store: WAL mode, one file, safe for several processes on one machine.

Every call runs on one dedicated thread that owns this process's connection, so the
event loop never blocks on SQLite. Writes use ``BEGIN IMMEDIATE``: the write lock is
taken up front, so two processes never deadlock upgrading a read lock, and the token
checks in ``queries.sql`` run under that lock. ``synchronous=NORMAL`` in WAL mode
survives a crash of any process (kill -9); only an operating system crash or power loss
can drop the last commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ..._clock import Clock, SystemClock
from ..._errors import (
    JobNotFoundError,
    SchemaVersionError,
    StoreCorruptError,
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
    QueueStats,
    RescueReport,
    StaleCommit,
    WorkerRecord,
    attempt_from_row,
    finish_transition,
    job_from_row,
)
from ..._ledger import Fence
from .._sql import load_queries
from ..base import Capabilities, FencedTransaction, ResourceLease, Store
from .ledger import LQ, SQLiteLedger, immediate, insert_job

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

log = logging.getLogger("tokenline.store.sqlite")

SCHEMA_VERSION = 2
Q = load_queries(__name__.rpartition(".")[0])
T = TypeVar("T")

#: Environment switch for tests and drills only: check job state but not the token.
UNSAFE_ENV = "TOKENLINE_TEST_UNSAFE_DISABLE_FENCING"


def path_from_url(url: str) -> Path:
    """The database file named by a ``sqlite:///relative`` or ``sqlite:////abs`` URL."""
    if not url.startswith("sqlite:///"):
        raise StoreError(f"not a SQLite URL: {url!r} (expected sqlite:///path/to/file.db)")
    raw = url[len("sqlite:///") :]
    if raw in ("", ":memory:"):
        raise StoreError(
            f"{url!r} names no file; worker processes must share one file "
            "(use memory:// for a single-process store)"
        )
    return Path(raw)


@contextlib.contextmanager
def map_sqlite_errors(path: Path) -> Iterator[None]:
    """Translate ``sqlite3`` errors into tokenline's exception tree."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc)
        if "locked" in text or "busy" in text:
            raise StoreUnavailableError(f"SQLite store {str(path)!r} is busy: {text}") from exc
        if "unable to open" in text or "readonly" in text or "disk I/O" in text:
            raise StoreUnavailableError(
                f"cannot use SQLite store {str(path)!r}: {text} "
                "(check that the directory exists and is writable)"
            ) from exc
        raise StoreError(f"SQLite store {str(path)!r}: {text}") from exc
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.IntegrityError):
            raise StoreError(f"SQLite store {str(path)!r} refused a write: {exc}") from exc
        raise StoreCorruptError(
            f"{str(path)!r} is not a usable tokenline store ({exc}); nothing was changed"
        ) from exc


def _connect(path: Path, *, busy_timeout: float, same_thread: bool = True) -> sqlite3.Connection:
    conn = sqlite3.connect(
        path, isolation_level=None, timeout=busy_timeout, check_same_thread=same_thread
    )
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def _statements(script: str) -> Iterator[str]:
    """Split a script into complete statements (a trigger body holds semicolons)."""
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            yield buf.strip()
            buf = ""
    if buf.strip() and not buf.strip().startswith("--"):
        yield buf.strip()


def _worker(row: sqlite3.Row) -> WorkerRecord:
    return WorkerRecord(
        id=row["id"],
        host=row["host"],
        pid=row["pid"],
        queues=tuple(json.loads(row["queues"])),
        concurrency=row["concurrency"],
        state=row["state"],
        token=row["token"],
        started_at=row["started_at"],
        heartbeat_at=row["heartbeat_at"],
        expires_at=row["expires_at"],
        in_flight=row["in_flight"],
    )


def _taken_over(holder: tuple[int, str | None] | None, token: int, owner: str) -> bool:
    """Whether a refused renewal was stale (someone else's token or owner), rather than
    of a job this owner finished itself or whose lease merely expired."""
    if holder is None:
        return True
    current_token, current_owner = holder
    return current_token != token or (current_owner is not None and current_owner != owner)


def finish_params(fin: Finish, now: float) -> dict[str, Any]:
    """Named parameters of the ``finish`` query for one :class:`Finish`."""
    move = finish_transition(fin)
    return {
        "state": move.state.value,
        "run_at": None if move.delay is None else now + move.delay,
        "refund": move.refund,
        "error": fin.error,
        "error_class": fin.error_class,
        "finished_at": now if move.finished else None,
        "now": now,
        "job_id": fin.lease.job_id,
        "token": fin.lease.token,
        "owner": fin.lease.owner,
        "outcome": fin.outcome.value,
    }


class SQLiteStore(SQLiteLedger, Store):
    """A store in one SQLite file (``sqlite:///path.db``)."""

    capabilities = Capabilities(multi_process=True, transactional_completion=True, ledger=True)

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.path = path_from_url(url)
        self.clock: Clock = clock or SystemClock()
        self.timeout = timeout
        self.unsafe_disable_fencing = os.environ.get(UNSAFE_ENV) == "1"
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None

    # -- plumbing -------------------------------------------------------------------------
    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._executor is None or self._conn is None:
            raise StoreError("the SQLite store is not open; call open() first")
        conn = self._conn

        def run() -> T:
            with map_sqlite_errors(self.path):
                return fn(conn)

        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._executor, run), timeout=self.timeout
            )
        except TimeoutError:
            raise StoreUnavailableError(
                f"SQLite store {str(self.path)!r} did not answer within {self.timeout:g}s"
            ) from None

    _write = staticmethod(immediate)

    def _q(self, name: str) -> str:
        if self.unsafe_disable_fencing and name in ("finish", "fence_check", "renew"):
            return Q[f"{name}_unfenced"]
        return Q[name]

    # -- life cycle -----------------------------------------------------------------------
    async def open(self) -> None:
        """Open the file (creating it and the schema if new) and check its version."""
        if self._executor is not None:
            return
        parent = self.path.parent
        if not parent.is_dir():
            raise StoreUnavailableError(
                f"cannot open SQLite store {str(self.path)!r}: "
                f"directory {str(parent)!r} does not exist"
            )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenline-sqlite")
        loop = asyncio.get_running_loop()
        try:
            self._conn = await loop.run_in_executor(self._executor, self._open_sync)
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise
        if self.unsafe_disable_fencing:
            log.warning("fencing token checks are DISABLED (%s=1): tests only", UNSAFE_ENV)

    def _open_sync(self) -> sqlite3.Connection:
        with map_sqlite_errors(self.path):
            conn = _connect(self.path, busy_timeout=self.timeout)
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"cannot switch {str(self.path)!r} to WAL (got {mode})")
                self._migrate(conn)
            except BaseException:
                conn.close()
                raise
            return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{str(self.path)!r} has schema version {version}, newer than this "
                f"tokenline's {SCHEMA_VERSION}: upgrade tokenline"
            )
        if version == SCHEMA_VERSION:
            return
        # Schema and version in one transaction: a crash (or a failing statement) leaves
        # the file as it was; a concurrent starter waits for the lock, then finds it done.
        with self._write(conn):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version >= SCHEMA_VERSION:
                return
            if version == 0:
                for statement in _statements(Q["schema"]):
                    conn.execute(statement)
            # 1 -> 2: the ledger (unique keys, effects, fences, duplicates).
            for statement in _statements(LQ["schema_v2"]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")

    async def close(self) -> None:
        """Close the connection and its thread."""
        if self._executor is None:
            return
        conn, executor = self._conn, self._executor
        self._conn, self._executor = None, None
        if conn is not None:
            executor.submit(conn.close).result()
        executor.shutdown(wait=True)

    # -- broker ---------------------------------------------------------------------------
    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        """Insert all jobs in one transaction and return their ids.

        With ``connection`` (a ``sqlite3.Connection`` to this file inside the caller's
        open transaction) the rows are inserted in that transaction instead.
        """

        def rows_for(now: float) -> list[dict[str, Any]]:
            rows = []
            for j in jobs:
                run_at = j.run_at if j.run_at is not None else now + (j.delay or 0.0)
                rows.append(
                    {
                        "queue": j.queue,
                        "task": j.task,
                        "args": j.args,
                        "idempotency_key": j.idempotency_key,
                        "priority": j.priority,
                        "run_at": run_at,
                        "max_attempts": j.max_attempts,
                        "state": "scheduled" if run_at > now else "queued",
                        "now": now,
                        "timeout": j.timeout,
                    }
                )
            return rows

        def run(conn: sqlite3.Connection) -> list[int]:
            rows = rows_for(self.clock.now())
            if any(j.unique is not None for j in jobs):
                pairs = zip(rows, jobs, strict=True)
                with self._write(conn):
                    return [insert_job(conn, Q["enqueue"], *rj) for rj in pairs]
            with self._write(conn):
                first = conn.execute(Q["last_job_id"]).fetchone()
                conn.executemany(Q["enqueue"], rows)
                last = conn.execute(Q["last_job_id"]).fetchone()[0]
            start = (first[0] if first else 0) + 1
            # AUTOINCREMENT under BEGIN IMMEDIATE: ids of this batch are contiguous.
            if last - start + 1 != len(rows):
                raise StoreError("enqueue ids are not contiguous; this is a bug")
            return list(range(start, last + 1))

        if not jobs:
            return []
        if connection is not None:
            if not isinstance(connection, sqlite3.Connection) or not connection.in_transaction:
                raise StoreError(
                    "connection= must be a sqlite3.Connection inside an open transaction"
                )
            with map_sqlite_errors(self.path):
                rows = rows_for(self.clock.now())
                pairs = zip(rows, jobs, strict=True)
                return [insert_job(connection, Q["enqueue"], *rj) for rj in pairs]
        return await self._call(run)

    async def jobs_claim(
        self, *, owner: str, queues: Sequence[str], limit: int, ttl: float
    ) -> list[ClaimedJob]:
        """Lease up to ``limit`` ready jobs to ``owner`` in one statement."""

        def run(conn: sqlite3.Connection) -> list[ClaimedJob]:
            now = self.clock.now()
            with self._write(conn):
                candidates = []
                for queue in dict.fromkeys(queues):
                    candidates += conn.execute(
                        Q["claim_candidates"], {"queue": queue, "now": now, "limit": limit}
                    ).fetchall()
                candidates.sort(key=lambda r: (-r[1], r[2], r[0]))
                ids = json.dumps([r[0] for r in candidates[:limit]])
                params = {"owner": owner, "ids": ids, "ttl": ttl, "now": now}
                rows = conn.execute(Q["claim"], params).fetchall() if candidates else []
                conn.executemany(
                    Q["attempt_start"],
                    [
                        {
                            "job_id": r["id"],
                            "token": r["lease_token"],
                            "attempt": r["attempt"],
                            "owner": owner,
                            "now": now,
                        }
                        for r in rows
                    ],
                )
            jobs = sorted(
                (job_from_row(r) for r in rows), key=lambda j: (-j.priority, j.run_at, j.id)
            )
            return [
                ClaimedJob(j, Lease(j.id, owner, j.lease_token, j.lease_expires_at or now + ttl))
                for j in jobs
            ]

        return await self._call(run)

    async def leases_renew(
        self, *, owner: str, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | None]:
        """Extend every held lease in one statement; report the lost ones."""

        def run(conn: sqlite3.Connection) -> list[Lease | None]:
            now = self.clock.now()
            held = json.dumps([[lease.job_id, lease.token] for lease in leases])
            with self._write(conn):
                rows = conn.execute(
                    self._q("renew"), {"leases": held, "owner": owner, "ttl": ttl, "now": now}
                ).fetchall()
                renewed = {r[0]: r[1] for r in rows}
                lost = [lease for lease in leases if lease.job_id not in renewed]
                if lost:
                    current = conn.execute(
                        Q["lease_holders"], {"ids": json.dumps([x.job_id for x in lost])}
                    ).fetchall()
                    holders = {r[0]: (r[1], r[2]) for r in current}
                    stale = [x for x in lost if _taken_over(holders.get(x.job_id), x.token, owner)]
                    self._record_stale(conn, stale, "renew", now)
            return [
                Lease(lease.job_id, owner, lease.token, renewed[lease.job_id])
                if lease.job_id in renewed
                else None
                for lease in leases
            ]

        if not leases:
            return []
        return await self._call(run)

    @staticmethod
    def _record_stale(
        conn: sqlite3.Connection, leases: Sequence[Lease], operation: str, now: float
    ) -> None:
        conn.executemany(
            Q["stale_insert"],
            [
                {
                    "job_id": lease.job_id,
                    "token": lease.token,
                    "owner": lease.owner,
                    "operation": operation,
                    "now": now,
                }
                for lease in leases
            ],
        )

    def finish_in(self, conn: sqlite3.Connection, finishes: Sequence[Finish]) -> list[bool]:
        """Apply ``finishes`` on ``conn`` inside the caller's write transaction."""
        now = self.clock.now()
        out = []
        stale = []
        query = self._q("finish")
        for fin in finishes:
            params = finish_params(fin, now)
            ok = conn.execute(query, params).rowcount == 1
            if ok:
                conn.execute(Q["attempt_finish"], params)
            else:
                stale.append((fin.lease, fin.outcome.value))
            out.append(ok)
        for lease, operation in stale:
            self._record_stale(conn, [lease], operation, now)
        return out

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        """Apply the batch in one transaction, each row fenced by its own token."""

        def run(conn: sqlite3.Connection) -> list[bool]:
            with self._write(conn):
                return self.finish_in(conn, finishes)

        if not finishes:
            return []
        return await self._call(run)

    async def jobs_rescue(self, *, limit: int = 1000) -> RescueReport:
        """Requeue or dead-letter running jobs whose lease expired by the store's clock."""

        def run(conn: sqlite3.Connection) -> RescueReport:
            now = self.clock.now()
            params = {"now": now, "limit": limit}
            with self._write(conn):
                conn.execute(Q["rescue_attempts"], params)
                rows = conn.execute(Q["rescue"], params).fetchall()
            return RescueReport(
                requeued=sorted(r[0] for r in rows if r[1] == "queued"),
                dead=sorted(r[0] for r in rows if r[1] == "dead"),
            )

        return await self._call(run)

    # -- queues ---------------------------------------------------------------------------
    async def queue_pause(self, *, queue: str) -> None:
        """Stop claims from ``queue``."""
        await self._call(lambda c: c.execute(Q["pause"], {"queue": queue, "now": self.clock.now()}))

    async def queue_resume(self, *, queue: str) -> None:
        """Allow claims from ``queue``."""
        await self._call(lambda c: c.execute(Q["resume"], {"queue": queue}))

    async def queues_stats(self) -> list[QueueStats]:
        """Per-queue counts by state, oldest ready age and paused flag."""

        def run(conn: sqlite3.Connection) -> list[QueueStats]:
            now = self.clock.now()
            counts: dict[str, dict[str, int]] = {}
            for row in conn.execute(Q["stats_counts"]):
                counts.setdefault(row[0], {})[row[1]] = row[2]
            oldest = {r[0]: r[1] for r in conn.execute(Q["stats_oldest"], {"now": now})}
            paused = {r[0] for r in conn.execute(Q["paused_list"])}
            return [
                QueueStats(
                    q,
                    counts.get(q, {}),
                    (now - oldest[q]) if q in oldest else None,
                    q in paused,
                )
                for q in sorted(set(counts) | paused)
            ]

        return await self._call(run)

    # -- inspection -----------------------------------------------------------------------
    async def job_get(self, *, job_id: int) -> Job:
        """The job, or :class:`JobNotFoundError`."""
        row = await self._call(lambda c: c.execute(Q["job_get"], {"job_id": job_id}).fetchone())
        if row is None:
            raise JobNotFoundError(f"no job with id {job_id}")
        return job_from_row(row)

    async def jobs_list(
        self, *, state: JobState | None = None, queue: str | None = None, limit: int = 100
    ) -> list[Job]:
        """Jobs filtered by state and queue, newest first."""
        params = {"state": state.value if state else None, "queue": queue, "limit": limit}
        rows = await self._call(lambda c: c.execute(Q["jobs_list"], params).fetchall())
        return [job_from_row(r) for r in rows]

    async def job_attempts(self, *, job_id: int) -> list[Attempt]:
        """Attempts of the job, oldest first."""
        await self.job_get(job_id=job_id)
        rows = await self._call(
            lambda c: c.execute(Q["attempts_list"], {"job_id": job_id}).fetchall()
        )
        return [attempt_from_row(r) for r in rows]

    async def jobs_retry_dead(self, *, job_ids: Sequence[int]) -> int:
        """Requeue dead jobs with a fresh attempt budget."""
        params = {"ids": json.dumps(list(job_ids)), "now": self.clock.now()}
        return await self._call(lambda c: c.execute(Q["retry_dead"], params).rowcount)

    async def jobs_cancel(self, *, job_ids: Sequence[int], reason: str) -> int:
        """Cancel queued, scheduled or dead jobs."""
        params = {"ids": json.dumps(list(job_ids)), "now": self.clock.now(), "reason": reason}
        return await self._call(lambda c: c.execute(Q["cancel"], params).rowcount)

    async def stale_commits(self, *, limit: int = 100) -> tuple[int, list[StaleCommit]]:
        """Total refused writes and the most recent ``limit``."""

        def run(conn: sqlite3.Connection) -> tuple[int, list[StaleCommit]]:
            total = conn.execute(Q["stale_count"]).fetchone()[0]
            rows = conn.execute(Q["stale_list"], {"limit": limit}).fetchall()
            return total, [StaleCommit(*tuple(r)) for r in rows]

        return await self._call(run)

    # -- workers and leases ---------------------------------------------------------------
    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        """Register (or re-register) a worker with a fresh membership token."""
        params = {
            "id": record.id,
            "host": record.host,
            "pid": record.pid,
            "queues": json.dumps(list(record.queues)),
            "concurrency": record.concurrency,
            "state": record.state,
            "now": self.clock.now(),
            "ttl": ttl,
        }
        row = await self._call(lambda c: c.execute(Q["worker_register"], params).fetchone())
        return _worker(row)

    async def worker_heartbeat(
        self, *, worker_id: str, token: int, state: str, in_flight: int, ttl: float
    ) -> WorkerRecord | None:
        """Extend the membership lease; ``None`` if it was lost."""
        params = {
            "id": worker_id,
            "token": token,
            "state": state,
            "in_flight": in_flight,
            "now": self.clock.now(),
            "ttl": ttl,
        }
        row = await self._call(lambda c: c.execute(Q["worker_heartbeat"], params).fetchone())
        return None if row is None else _worker(row)

    async def worker_deregister(self, *, worker_id: str, token: int) -> None:
        """Mark the worker stopped."""
        params = {"id": worker_id, "token": token, "now": self.clock.now()}
        await self._call(lambda c: c.execute(Q["worker_deregister"], params))

    async def workers_list(self) -> list[WorkerRecord]:
        """All workers, newest first."""
        rows = await self._call(lambda c: c.execute(Q["workers_list"]).fetchall())
        return [_worker(r) for r in rows]

    async def lease_acquire(self, *, resource: str, owner: str, ttl: float) -> ResourceLease | None:
        """Take, or renew, the named lease."""
        params = {"resource": resource, "owner": owner, "ttl": ttl, "now": self.clock.now()}
        row = await self._call(lambda c: c.execute(Q["lease_acquire"], params).fetchone())
        return None if row is None else ResourceLease(*tuple(row))

    async def lease_release(self, *, lease: ResourceLease) -> bool:
        """Release the named lease if ``(owner, token)`` still holds it."""
        params = {
            "resource": lease.resource,
            "owner": lease.owner,
            "token": lease.token,
            "now": self.clock.now(),
        }
        return bool(await self._call(lambda c: c.execute(Q["lease_release"], params).rowcount))

    # -- transactions ---------------------------------------------------------------------
    def fenced_transaction(
        self, *, lease: Lease, fences: Sequence[Fence] = ()
    ) -> FencedTransaction:
        """A transaction on this file that checks ``lease`` first, then advances
        ``fences``, and completes the job on commit."""
        from ._transaction import SQLiteFencedTransaction  # it builds on this module

        return SQLiteFencedTransaction(self, lease, fences)
