"""PostgreSQL store: any number of worker machines on one database.

Every operation is one statement (or one short transaction) from ``queries.sql`` on a
connection of a psycopg async pool (a sync handler's fenced transaction takes one of a
sync pool, opened on first use). The guarantees of ``stores/base.py`` come from the
database, not from this process:

* Claims take rows with ``FOR NO KEY UPDATE SKIP LOCKED``: concurrent claimers on any
  machine never wait for each other and never share a job; the token bump and the attempt row
  happen in the same statement.
* ``jobs_finish`` and ``job_leases_renew`` are one statement per batch, each row conditional
  on its own ``(id, lease_token, lease_owner, state = 'running')``; refused rows are
  written to ``stale_commits`` by that same statement.
* A trigger refuses any backwards job state move, whatever SQL is sent.
* Time is the database's (``statement_timestamp()``), so lease expiry never depends on a
  worker's clock; a store built with an explicit ``clock`` (tests) passes its ``now``
  into every statement instead.

Tables live in the URL's ``?schema=`` (default ``tokenline``), created and upgraded by
versioned migrations (``migrations.sql``) on :meth:`PostgresStore.open`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import psycopg
from psycopg import AsyncConnection, AsyncRawCursor, sql
from psycopg.pq import TransactionStatus
from psycopg.rows import DictRow, TupleRow, dict_row, tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed

from ..._clock import Clock, SystemClock
from ..._errors import (
    InvalidInputError,
    JobNotFoundError,
    StoreCorruptError,
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
    QueueStats,
    RescueCandidate,
    RescueReport,
    StaleCommit,
    WorkerRecord,
    finish_transition,
    renewal_was_stale,
    rescue_transition,
)
from ..._records import Fence
from .._rows import attempt_from_row, job_from_row, worker_from_row
from .._sql import load_queries
from ..base import (
    Capabilities,
    Depth,
    FencedTransaction,
    ResourceLease,
    Store,
    possible_job_id,
    possible_job_ids,
)
from . import _direct as direct
from ._arrays import ADAPTERS, BinaryArray, float_array
from ._catalog import check_objects
from ._connect import RecordingAsyncConnection, RecordingConnection, ended_while_idle
from ._cutoff import Cutoffs
from ._deadline import run_bounded
from ._errors import (
    ReadOnlyServerError,
    is_read_only,
    map_postgres_errors,
    maybe_made,
    migration_refused,
    read_only_message,
)
from ._lent import read_only_by_default, read_only_by_default_async
from ._listener import Listener
from ._migrations import (
    SCHEMA_VERSION,
    apply_migrations,
    compose,
    schema_version,
    too_new,
    too_old,
)
from ._notifier import Notifier
from ._raw import RawStatement, needs_raw
from ._steps import (
    AsyncDriver,
    Begin,
    Copy,
    End,
    Steps,
    SyncDriver,
    execute,
    fetch_all,
    fetch_one,
)
from ._target import Target, parse_url
from ._transaction import PostgresFencedTransaction
from .ledger import PostgresLedger
from .maintenance import PostgresMaintenance, check_leader
from .retention import PostgresRetention

__all__ = ["SCHEMA_VERSION", "PostgresStore"]

log = logging.getLogger("tokenline.store.postgres")

#: Batches of at least this many jobs are copied in (their unique keys taken first).
COPY_THRESHOLD = 64

#: The range of PostgreSQL's ``integer`` columns.
_INT4 = (-(2**31), 2**31 - 1)


def _answered(jobs: Sequence[NewJob], rows: Sequence[TupleRow]) -> tuple[list[int], set[str]]:
    """The ids the enqueue statements' ``rows`` (id, whether inserted ready now, …)
    give ``jobs``, and the queues that got a job ready now: those to notify."""
    ready = {j.queue for j, row in zip(jobs, rows, strict=True) if row[1]}
    return [row[0] for row in rows], ready


def _check_values(jobs: Sequence[NewJob]) -> None:
    """Refuse, with :class:`InvalidInputError`, what the columns cannot hold, the same
    way on both paths: a binary COPY writes an integer out of its column's range
    wrapped around, where the statement is refused by the server; a ``bool`` goes in as
    0 or 1; a value of another type fails inside psycopg. The App validates these
    already: a store called directly may not have."""
    low, high = _INT4
    for n, j in enumerate(jobs):
        for field, value in (
            ("priority", j.priority),
            ("max_attempts", j.max_attempts),
            ("max_lease_expiries", j.max_lease_expiries),
        ):
            if type(value) is not int or not low <= value <= high:
                why = f"{field} {value!r} is not an integer from {low} to {high}"
                raise InvalidInputError(f"job {n} of the batch: {why}; nothing was enqueued")
        for field, seconds in (("timeout", j.timeout), ("run_at", j.run_at), ("delay", j.delay)):
            if seconds is not None and type(seconds) not in (int, float):
                why = f"{field} {seconds!r} is not a number of seconds"
                raise InvalidInputError(f"job {n} of the batch: {why}; nothing was enqueued")


#: The types of enqueue_copy's columns, in its order (queries.sql).
ENQUEUE_COPY_TYPES = (
    *("bigint", "text", "text", "text", "text", "integer", "double precision", "integer"),
    *("text", "double precision", "double precision", "double precision", "integer"),
)

T = TypeVar("T")


def _with_fragments(queries: dict[str, str]) -> dict[str, str]:
    """``queries`` with the shared end of the unique-key insert put in its place."""
    take = queries.pop("unique_key_take")
    return {name: text.replace("{unique_key_take}", take) for name, text in queries.items()}


_Q = _with_fragments(
    {
        **load_queries(__name__.rpartition(".")[0]),
        **load_queries(__name__.rpartition(".")[0], "ledger.sql"),
    }
)


def fuse_finish_claim(finish: str, claim: str) -> str:
    """One statement that runs the ``finish`` query's steps, then the ``claim`` query's
    (queries.sql), answering each claimed row with the finished rows' ordinals beside it
    (``finished_ords``; one row with a NULL ``id`` when nothing was claimed).

    Both are lists of CTEs over one ``clock``; the claim's are kept whole, the finish's
    join them without their own clock. A job the finish makes ready again is claimed by
    the next claim at the earliest: the claim updates rows as the statement's snapshot
    shows them, and never a row the same statement has updated (its candidates are read
    by runnable_jobs, whose own statements may see the finish's changes). The rows they
    update are apart: the finish's are running, the claim's queued. Built from
    the two texts rather than written a third time; a change of their shape that this
    cannot follow is an error at the first use, not a different statement.
    """
    head, tail = "WITH ", "\nSELECT ord FROM done;"
    claim_head, claim_tail = "WITH RECURSIVE ", "\nSELECT cl.*\nFROM claimed AS cl, clock AS c\n"
    if not (finish.startswith(head) and finish.endswith(tail)):
        raise StoreError("the finish query no longer has the shape finish_claim expects")
    if not (claim.startswith(claim_head) and claim_tail in claim):
        raise StoreError("the claim query no longer has the shape finish_claim expects")
    finish_ctes = [
        line
        for line in finish[len(head) : -len(tail)].split("\n")
        if not line.startswith("clock AS (")
    ]
    claim_ctes, order = claim[len(claim_head) :].split(claim_tail, 1)
    return (
        f"{claim_head}{claim_ctes},\n"
        + "\n".join(finish_ctes)
        + "\nSELECT (SELECT array_agg(ord) FROM done) AS finished_ords, cl.*\n"
        + "FROM (SELECT 1) AS one LEFT JOIN claimed AS cl ON true, clock AS c\n"
        + order
    )


#: Claims of at most this many jobs have their size written into the statement's text
#: (see the claim query in queries.sql), so that the server keeps one plan for each: at
#: most this many texts per claim statement and connection, well inside psycopg's cache
#: of prepared statements. A bigger claim keeps the parameter and may be planned afresh,
#: a cost its jobs share.
LITERAL_CLAIM_LIMIT = 16


#: An array parameter of a batch statement, with its element type: ``%(name)s::type[]``.
_ARRAY_PARAMETER = re.compile(r"%\((\w+)\)s::([a-z ]+)\[\]")


def for_one_row(text: str) -> str:
    """The batch statement ``text`` for a batch of one: each array parameter
    ``%(name)s::type[]`` written ``ARRAY[%(name)s::type]``, to be given the one value.

    Given arrays, the server plans for a batch of unknown size (ten rows, it guesses),
    which looks costlier than the plan for the one row it is mostly given: it then plans
    the statement afresh on every call, which took about as long as running it. With
    the array's length in the text, the plan it keeps is the plan for one row."""
    one, found = _ARRAY_PARAMETER.subn(r"ARRAY[%(\1)s::\2]", text)
    if not found:
        raise StoreError("a batch statement has no array parameter to write for one row")
    return one


def _one_row(params: dict[str, Any]) -> dict[str, Any]:
    """A batch statement's parameters for a batch of one (see :func:`for_one_row`):
    each list's one element."""
    return {k: v[0] if isinstance(v, list) else v for k, v in params.items()}


def with_claim_limit(text: str, limit: int) -> str:
    """The claim statement ``text`` for a claim of ``limit`` jobs: the number in place
    of its ``%(limit)s`` parameter when the claim is small, else ``text`` itself."""
    if not 0 < limit <= LITERAL_CLAIM_LIMIT:
        return text
    return text.replace("%(limit)s", str(int(limit)))


class PostgresStore(PostgresMaintenance, PostgresRetention, PostgresLedger, Store):
    """A store in a PostgreSQL schema (``postgresql://user@host/db?schema=name``).

    ``timeout`` bounds connecting, waiting for a pooled connection and each statement
    (``statement_timeout``); an operation never hangs past it. ``migrate=False`` makes
    :meth:`open` refuse a schema that needs migrating instead of migrating it (run
    ``tokenline migrate`` then). ``max_connections`` caps the pool, the sync pool of
    blocking enqueues, and the two pools lent to fenced transactions (one per form,
    read-only at rest, see ``_lent.py``); those three stay empty until first used.
    """

    capabilities = Capabilities(
        multi_process=True,
        transactional_completion=True,
        notifications=True,
        ledger=True,
        placeholder="%s",
        blocking_enqueue=True,
    )

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        timeout: float = 10.0,
        migrate: bool = True,
        max_connections: int = 10,
    ) -> None:
        self.target: Target = parse_url(url, timeout=timeout)
        #: The schema holding this store's tables.
        self.schema = self.target.schema
        self.clock: Clock = clock or SystemClock()
        # Without an injected clock "now" is the database's: statements get now=NULL.
        self._clock_given = clock is not None
        self.timeout = timeout
        self.migrate_on_open = migrate
        self.max_connections = max_connections
        self._queries = {name: compose(text, self.schema) for name, text in _Q.items()}
        # The finish of one job (see for_one_row), from _q's text on first use: a
        # subclass that rewrites that text rewrites this one too.
        self._finish_one_text: str | None = None
        self._guarded_finish_text: str | None = None
        self._enqueue_one_raw: RawStatement | None = None
        # The claim statements by (fused with a finish, the size written in or 0), built once.
        self._claim_texts: dict[tuple[bool, bool, int], str] = {}
        # Statements too long for psycopg's cache, converted once (see _raw.py).
        self._raw: dict[str, RawStatement] = {}
        self._schema_tag = f"{zlib.crc32(self.schema.encode()):08x}"
        self._pool: AsyncConnectionPool[AsyncConnection[TupleRow]] | None = None
        # Sync handlers' fenced transactions run in their own threads: they get blocking
        # connections from a pool of their own, opened on first use (see _checkout_sync).
        self._sync_pool: ConnectionPool[psycopg.Connection[TupleRow]] | None = None
        self._sync_pool_lock = threading.Lock()
        # Connections lent to ctx.transaction() blocks come from pools of their own whose
        # transactions are read-only unless tokenline begins them (see _lent.py): a
        # reference the block kept cannot write through one later.
        self._lent_pool: AsyncConnectionPool[AsyncConnection[TupleRow]] | None = None
        self._lent_sync_pool: ConnectionPool[psycopg.Connection[TupleRow]] | None = None
        self._listener: Listener | None = None
        # Sends the wake-ups of this store's own enqueues after their commit.
        self._notifier: Notifier | None = None
        # Last resort against a peer that stops answering (see _deadline.py): waiting
        # for a pooled connection and the statements each get ``timeout``, plus slack.
        self._deadline = 2 * timeout + 1
        # The same for the blocking connections of callers' threads (see _cutoff.py).
        self._cutoffs = Cutoffs(f"tokenline-{self.schema}")

    # -- plumbing -------------------------------------------------------------------------
    def _q(self, name: str) -> str:
        """The query ``name``, composed for this store's schema."""
        return self._queries[name]

    def _now(self) -> float | None:
        return self.clock.now() if self._clock_given else None

    async def write_probe(self, channel: str, timeout: float) -> None:  # noqa: ASYNC109
        """For ``tokenline status``: whether ``channel`` ("broker", "leases" or
        "ledger") can write now, not only read. Writes nothing.

        Raises :class:`ReadOnlyServerError` when this role's sessions can write nothing
        (a hot standby, or ``default_transaction_read_only`` on): reads answer there,
        so the channel looked ok while every write failed. Then takes, and gives
        straight back, the lock the channel's writes take on each of its tables
        (:attr:`probed_tables`), waiting at most ``timeout`` seconds in all, and raises
        TimeoutError naming the table that stayed locked (a ``LOCK TABLE``, a ``VACUUM
        FULL`` or a ``CLUSTER`` holding it): reads pass while those writes queue. The
        lock is the one ordinary writes take, so other transactions' writes, however
        long, do not hold it against the probe."""
        tables, what = self.probed_tables[channel]
        deadline = asyncio.get_running_loop().time() + timeout
        locked: list[str] = []

        async def run(conn: AsyncConnection[Any]) -> None:
            async with conn.transaction():
                cur = conn.cursor(row_factory=tuple_row)
                await cur.execute(
                    "SELECT current_setting('transaction_read_only') = 'on', pg_is_in_recovery()"
                )
                row = await cur.fetchone()
                if row is not None and row[0]:  # one row, always
                    raise ReadOnlyServerError(
                        read_only_message(self.target, f"{what} are refused", standby=bool(row[1]))
                    )
                # Those there: the split ledger's own tables are made by the first
                # worker's open, which status does not do.
                await cur.execute(
                    "SELECT c.relname FROM pg_catalog.pg_class AS c "
                    "JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = %s AND c.relname = ANY(%s)",
                    (self.target.schema, list(tables)),
                )
                there = {str(r[0]) for r in await cur.fetchall()}
                for table in (t for t in tables if t in there):
                    left = deadline - asyncio.get_running_loop().time()
                    ms = max(1, int(left * 1000))
                    await cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{ms}ms",))
                    locked[:] = [table]
                    name = sql.SQL("{}.{}").format(
                        sql.Identifier(self.target.schema), sql.Identifier(table)
                    )
                    await conn.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(name))

        try:
            await self._call(run)
        except StoreError as exc:
            if isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
                raise TimeoutError(
                    f"the {locked[0]} table of {self.target.where} stayed locked against "
                    f"writes for {timeout:g}s: {what} wait"
                ) from exc
            raise

    #: The tables each channel's writes lock, and what those writes are: the
    #: channels :meth:`write_probe` asks of.
    probed_tables: ClassVar[dict[str, tuple[tuple[str, ...], str]]] = {
        "broker": (("jobs", "attempts", "unique_keys"), "enqueues, claims and finishes"),
        "leases": (
            ("jobs", "workers", "leases"),
            "lease renewals, heartbeats and worker registration",
        ),
        "ledger": (
            ("open_blocks", "effects", "fences"),
            "the ledger's writes (effects, fences, fenced transactions)",
        ),
    }

    async def broker_write_probe(self, timeout: float) -> None:  # noqa: ASYNC109
        """For ``tokenline status``: :meth:`write_probe` of the broker channel."""
        await self.write_probe("broker", timeout)

    def _translate(self) -> contextlib.AbstractContextManager[None]:
        return map_postgres_errors(self.target, self.timeout)

    @contextlib.contextmanager
    def _translate_on_callers_connection(self) -> Iterator[None]:
        """:meth:`_translate`, saying what a missing schema means on the caller's own
        connection: nothing there creates it, and the caller's transaction is now
        aborted (it must be rolled back)."""
        try:
            with self._translate():
                yield
        except StoreCorruptError as exc:
            raise StoreCorruptError(
                f"{exc}. An enqueue on your own connection never creates the schema (it "
                "runs inside your transaction, which this error has aborted: roll it "
                "back): migrate first, with `tokenline migrate`, a worker, or an "
                "enqueue without connection="
            ) from exc

    def _require_pool(self) -> AsyncConnectionPool[AsyncConnection[TupleRow]]:
        if self._pool is None:
            raise StoreError("the PostgreSQL store is not open; call open() first")
        return self._pool

    async def _call(
        self, fn: Callable[[AsyncConnection[Any]], Awaitable[T]], *, enqueues: int = 0
    ) -> T:
        """Run ``fn`` on a pooled connection (autocommit), errors translated, the
        checkout and the statements together bounded by the store's deadline.

        ``enqueues``: ``fn`` enqueues that many jobs; a connection lost, or the deadline
        passed, once it began says that they may have been enqueued all the same
        (:class:`OutcomeUnknownError`), where a failed checkout says nothing was sent."""
        pool = self._require_pool()
        sent = False

        async def run() -> T:
            nonlocal sent
            conn = await pool.getconn(timeout=self.timeout)
            for _ in range(self.max_connections):
                if not ended_while_idle(conn):
                    break
                # Ended while it sat in the pool: put back closed, for the pool to
                # replace (see ended_while_idle); nothing was sent on it.
                await conn.close()
                await pool.putconn(conn)
                conn = await pool.getconn(timeout=self.timeout)
            try:
                sent = True
                return await fn(conn)
            except BaseException as exc:
                if is_read_only(exc):
                    # Its session stays read-only for good (a standby's, or one begun
                    # while the setting was on): closed, the pool opens a fresh one,
                    # which may reach a writable server.
                    await conn.close()
                raise
            finally:
                # The pool rolls back, or discards, a connection left in a transaction
                # or broken.
                await pool.putconn(conn)

        try:
            with self._translate():
                return await run_bounded(run(), self._deadline)
        except StoreUnavailableError as exc:
            if enqueues and sent and maybe_made(exc):
                raise enqueue_outcome_unknown(exc, enqueues) from exc
            raise

    async def _checkout(self) -> AsyncConnection[Any]:
        """A connection to lend to an ``async with`` fenced transaction, read-only until
        tokenline begins a transaction on it (see ``_lent.py``); give it back with
        ``_checkin``."""
        pool = self._lent_pool
        if pool is None or self._pool is None:
            raise StoreError("the PostgreSQL store is not open; call open() first")
        with self._translate():
            for more in range(self.max_connections, -1, -1):
                conn = await run_bounded(
                    pool.getconn(timeout=self.timeout), self._deadline, discard=pool.putconn
                )
                if not more or not ended_while_idle(conn):
                    return conn
                # Ended while it sat in the pool (see ended_while_idle): put back closed,
                # for the pool to replace; nothing was sent on it.
                await conn.close()
                await pool.putconn(conn)
            raise AssertionError("unreachable")  # pragma: no cover

    async def _checkin(self, conn: AsyncConnection[Any]) -> None:
        pool = self._lent_pool
        if pool is None:  # the store was closed meanwhile: the connection goes with it
            await conn.close()
            return
        await pool.putconn(conn)

    def _checkout_sync(
        self, *, lent: bool = False
    ) -> tuple[ConnectionPool[psycopg.Connection[TupleRow]], psycopg.Connection[Any]]:
        """A blocking connection, from any thread, and the pool to give it back to
        (``pool.putconn``: the pool rolls back, or discards, a connection left in a
        transaction or broken). Waits up to the store timeout. ``lent``: for a sync
        fenced transaction, read-only until tokenline begins a transaction on it."""
        with self._translate():
            pool = self._require_sync_pool(lent=lent)
            for _ in range(self.max_connections):
                pool, conn = self._getconn_sync(pool, lent=lent)
                if not ended_while_idle(conn):
                    return pool, conn
                # A session the server ended while it sat in the pool: put back closed,
                # for the pool to replace, as many times as the pool holds connections.
                conn.close()
                self._checkin_sync(pool, conn)
            return self._getconn_sync(pool, lent=lent)

    def _getconn_sync(
        self, pool: ConnectionPool[psycopg.Connection[TupleRow]], *, lent: bool
    ) -> tuple[ConnectionPool[psycopg.Connection[TupleRow]], psycopg.Connection[Any]]:
        """A connection of ``pool``, or of the pool that replaced it, with that pool."""
        while True:
            try:
                return pool, pool.getconn(timeout=self.timeout)
            except PoolClosed:
                # Retired by another thread meanwhile (see _retire_sync_pool): its
                # successor, unless the store itself was closed.
                successor = self._require_sync_pool(lent=lent)
                if successor is pool:
                    raise
                pool = successor
            except Exception:
                raise
            except BaseException:
                self._retire_sync_pool(pool)
                raise

    def _checkin_sync(
        self, pool: ConnectionPool[psycopg.Connection[TupleRow]], conn: psycopg.Connection[Any]
    ) -> None:
        """Give back a connection of :meth:`_checkout_sync` to ``pool``."""
        try:
            pool.putconn(conn)
        except Exception:
            raise
        except BaseException:
            self._retire_sync_pool(pool)
            raise

    def _retire_sync_pool(self, pool: ConnectionPool[psycopg.Connection[TupleRow]]) -> None:
        """Replace ``pool`` by a new one on the next checkout, and close it.

        psycopg_pool loses a connection when an exception that is not an ``Exception``
        (a ``KeyboardInterrupt`` or ``SystemExit`` a signal handler raised) interrupts a
        checkout while it waits: the abandoned place in its queue is handed the next
        connection given back, which nobody takes, and the pool counts it out for good
        (so can one interrupted while the pool takes a connection out or puts one back).
        After as many losses as the pool has connections, every blocking enqueue waited
        for the store timeout and failed, until the process ended. Connections still
        out of the retired pool are closed when they come back to it."""
        with self._sync_pool_lock:
            if self._sync_pool is pool:
                self._sync_pool = None
            elif self._lent_sync_pool is pool:
                self._lent_sync_pool = None
            else:
                return  # retired already
        # Closing joins the pool's threads: not on the interrupted caller's way.
        threading.Thread(target=pool.close, name=f"{pool.name}-retire", daemon=True).start()

    def _require_sync_pool(self, *, lent: bool) -> ConnectionPool[psycopg.Connection[TupleRow]]:
        with self._sync_pool_lock:
            self._require_pool()  # open, and not closed
            pool = self._lent_sync_pool if lent else self._sync_pool
            if pool is None:
                pool = ConnectionPool(
                    self.target.conninfo,
                    connection_class=RecordingConnection,
                    kwargs={"autocommit": True, "context": ADAPTERS},
                    configure=read_only_by_default if lent else None,
                    # No connection until one is asked for; then at most as many as the
                    # async pool, each held for one call or transaction.
                    min_size=0,
                    max_size=self.max_connections,
                    open=False,
                    timeout=self.timeout,
                    name=f"tokenline-{self.schema}-{'lent-sync' if lent else 'sync'}",
                )
                pool.open(wait=False)  # min_size=0: nothing to wait for
                if lent:
                    self._lent_sync_pool = pool
                else:
                    self._sync_pool = pool
            return pool

    async def _rows(self, query: str, params: dict[str, Any]) -> list[DictRow]:
        if needs_raw(query):
            raw = self._raw.get(query)
            if raw is None:
                raw = self._raw[query] = RawStatement.convert(query)
            values = raw.params(params)

            async def run_raw(conn: AsyncConnection[Any]) -> list[DictRow]:
                cur = AsyncRawCursor(conn, row_factory=dict_row)
                await cur.execute(raw.text, values)
                return await cur.fetchall()

            return await self._call(run_raw)

        async def run(conn: AsyncConnection[Any]) -> list[DictRow]:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(query, params)
            return await cur.fetchall()

        return await self._call(run)

    async def _tuples(
        self, query: str, params: dict[str, Any], *, enqueues: int = 0
    ) -> list[TupleRow]:
        async def run(conn: AsyncConnection[Any]) -> list[TupleRow]:
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(query, params)
            return await cur.fetchall()

        return await self._call(run, enqueues=enqueues)

    async def _rowcount(self, query: str, params: dict[str, Any]) -> int:
        async def run(conn: AsyncConnection[Any]) -> int:
            cur = conn.cursor()
            await cur.execute(query, params)
            return cur.rowcount

        return await self._call(run)

    async def _schema_check(self, *, migrate: bool) -> int:
        """Check the schema's version on a direct connection, migrating if allowed.

        Direct, not pooled: a wrong host, database or role is then reported with
        libpq's reason rather than as a pool timeout, and it works before ``open()``.
        """
        conn = await AsyncConnection.connect(self.target.conninfo, autocommit=True)
        try:
            version = await schema_version(conn, self.schema)
            if version > SCHEMA_VERSION:
                raise too_new(version, self.target)
            if version < SCHEMA_VERSION:
                if not migrate:
                    raise too_old(version, self.target)
                # The version read above was read without the lock: another process
                # may have migrated since. What this one did is what it found under it.
                try:
                    before, version = await apply_migrations(conn, self.target)
                except psycopg.errors.InsufficientPrivilege as exc:
                    raise migration_refused(self.target, version, SCHEMA_VERSION, exc) from exc
                if before < version:
                    self.migrated = (before, version)
            # The version says which migrations ran, not that what they made is there.
            await check_objects(conn, version, self.target)
            return version
        finally:
            await conn.close()

    # -- life cycle -----------------------------------------------------------------------
    async def open(self) -> None:
        """Check (and unless ``migrate=False``, migrate) the schema, then open the pool."""
        if self._pool is not None:
            return
        with self._translate():
            await run_bounded(self._schema_check(migrate=self.migrate_on_open), self._deadline)
            pool: AsyncConnectionPool[AsyncConnection[TupleRow]] = AsyncConnectionPool(
                self.target.conninfo,
                connection_class=RecordingAsyncConnection,
                kwargs={"autocommit": True, "context": ADAPTERS},
                min_size=1,
                max_size=self.max_connections,
                open=False,
                timeout=self.timeout,
                # No check on checkout: it would cost a round trip per operation. A
                # connection the server dropped fails its statement instead; callers
                # treat that as a coordination error and retry, and the pool discards
                # the broken connection when it is returned.
                name=f"tokenline-{self.schema}",
            )
            lent: AsyncConnectionPool[AsyncConnection[TupleRow]] = AsyncConnectionPool(
                self.target.conninfo,
                connection_class=RecordingAsyncConnection,
                kwargs={"autocommit": True, "context": ADAPTERS},
                configure=read_only_by_default_async,
                # No connection until an async handler opens a transaction.
                min_size=0,
                max_size=self.max_connections,
                open=False,
                timeout=self.timeout,
                name=f"tokenline-{self.schema}-lent",
            )
            try:
                await pool.open(wait=True, timeout=self.timeout)
                await lent.open(wait=False)  # min_size=0: nothing to wait for
            except BaseException:
                await pool.close()
                await lent.close()
                raise
        self._pool = pool
        self._lent_pool = lent
        self._listener = Listener(self.target.conninfo, self.target.channel, timeout=self.timeout)
        self._notifier = Notifier(self._notify, name=f"tokenline-{self.schema}-notify")

    async def missing(self) -> str | None:
        """What is missing for this store to exist, without creating anything: its
        schema, said with where it was looked for; ``None`` when it is installed, or
        when the server refuses the question (opening the store then says why).

        Raises :class:`~tokenline.StoreUnavailableError` when the server does not
        answer: opening it next would wait out the same timeout again to say so."""
        try:
            with self._translate():
                installed = await run_bounded(self._installed(), self._deadline)
        except StoreUnavailableError:
            raise
        except StoreError:
            return None
        if installed:
            return None
        return f"the tokenline schema {self.schema!r} of {self.target.where} is not installed"

    async def _installed(self) -> bool:
        conn = await AsyncConnection.connect(self.target.conninfo, autocommit=True)
        try:
            return await schema_version(conn, self.schema) > 0
        finally:
            await conn.close()

    async def migrate(self) -> int:
        """Bring the schema to this code's version and return it (``tokenline migrate``).

        Works on an unopened store. All pending migrations apply in one transaction under
        an advisory lock; a schema newer than this code raises
        :class:`~tokenline.SchemaVersionError` and is left untouched. Each statement is
        bounded by the store's ``timeout``: give a long migration a larger one.
        """
        self.migrated = None
        with self._translate():
            return await run_bounded(self._schema_check(migrate=True), self._deadline)

    async def close(self) -> None:
        """Stop listening and close the pools. Safe to call twice."""
        notifier, self._notifier = self._notifier, None
        if notifier is not None:
            # The wake-ups of the last enqueues, while the pools are still open.
            await asyncio.to_thread(notifier.close, self._deadline)
        with self._sync_pool_lock:
            listener, pool, lent = self._listener, self._pool, self._lent_pool
            sync_pools = [p for p in (self._sync_pool, self._lent_sync_pool) if p is not None]
            self._listener, self._pool, self._lent_pool = None, None, None
            self._sync_pool = self._lent_sync_pool = None
        if listener is not None:
            await listener.close()
        for async_pool in (pool, lent):
            if async_pool is not None:
                await async_pool.close()
        for sync_pool in sync_pools:
            # Joins the pool's threads: off the event loop. A connection still out (a
            # sync transaction open in another thread) is closed when it comes back.
            await asyncio.to_thread(sync_pool.close)

    # -- broker ---------------------------------------------------------------------------
    def _enqueue_slot(self) -> contextlib.AbstractContextManager[Notifier | None]:
        """Around an enqueue committed by tokenline: the notifier to hand its queues
        to after the commit, or ``None`` to notify in its transaction."""
        notifier = self._notifier
        return contextlib.nullcontext() if notifier is None else notifier.enqueue()

    def _notify(self, queues: list[str]) -> None:
        """Wake the workers waiting on ``queues``: a transaction of its own, after the
        commit of the jobs it announces, on the notifier's thread (see ``_notifier.py``)."""
        pool, conn = self._checkout_sync()
        try:
            with self._translate():
                conn.execute(self._q("enqueue_notify"), self._notify_params(queues))
        except StoreUnavailableError as exc:
            if is_read_only(exc):
                conn.close()  # never to be reused: see _call
            raise
        finally:
            self._checkin_sync(pool, conn)

    def _notify_params(self, queues: Iterable[str]) -> dict[str, Any]:
        """``enqueue_notify``'s parameters: each of ``queues`` once, in order."""
        return {"channel": self.target.channel, "queues": sorted(set(queues))}

    @staticmethod
    def _copies(jobs: Sequence[NewJob]) -> bool:
        """Whether ``jobs`` go in by COPY: a large batch (its unique keys are taken by a
        statement of their own first, see :meth:`_enqueue_copy_steps`)."""
        return len(jobs) >= COPY_THRESHOLD

    def _enqueue_statement(
        self, jobs: Sequence[NewJob], *, notify: bool
    ) -> tuple[str, dict[str, Any]]:
        """The enqueue statement for ``jobs`` and its parameters: a lone job without a
        unique key takes the single-row statement. ``notify``: in the statement's
        transaction (see ``_notifier.py``)."""
        if self._one_alone(jobs):
            return self._q("enqueue_one"), self._enqueue_one_params(jobs[0], notify=notify)
        return self._q("enqueue"), self._enqueue_params(jobs, notify=notify)

    @staticmethod
    def _one_alone(jobs: Sequence[NewJob]) -> bool:
        """Whether ``jobs`` take the single-row statement: one job, without a unique key."""
        return len(jobs) == 1 and jobs[0].unique is None

    def _enqueue_one_params(self, j: NewJob, *, notify: bool) -> dict[str, Any]:
        """The ``enqueue_one`` statement's parameters; ``notify``: in its transaction."""
        return {
            "queue": j.queue,
            "task": j.task,
            "args": j.args,
            "idempotency_key": j.idempotency_key,
            "priority": j.priority,
            "run_at": j.run_at,
            "delay": j.delay,
            "max_attempts": j.max_attempts,
            "max_lease_expiries": j.max_lease_expiries,
            "timeout": j.timeout,
            "now": self._now(),
            "channel": self.target.channel,
            "notify": notify,
        }

    def _enqueue_params(self, jobs: Sequence[NewJob], *, notify: bool) -> dict[str, Any]:
        """The ``enqueue`` statement's parameters; ``notify``: in its transaction."""
        return {
            "queue": BinaryArray([j.queue for j in jobs]),
            "task": BinaryArray([j.task for j in jobs]),
            "args": BinaryArray([j.args for j in jobs]),
            "idempotency_key": BinaryArray([j.idempotency_key for j in jobs]),
            "priority": BinaryArray([j.priority for j in jobs]),
            "run_at": float_array([j.run_at for j in jobs]),
            "delay": float_array([j.delay for j in jobs]),
            "max_attempts": BinaryArray([j.max_attempts for j in jobs]),
            "max_lease_expiries": BinaryArray([j.max_lease_expiries for j in jobs]),
            "timeout": float_array([j.timeout for j in jobs]),
            "unique": BinaryArray([None if j.unique is None else j.unique.value for j in jobs]),
            "unique_for": float_array([j.unique_for for j in jobs]),
            "now": self._now(),
            "channel": self.target.channel,
            "notify": notify,
        }

    def _enqueue_copy_steps(
        self, jobs: Sequence[NewJob], *, notify: bool
    ) -> Steps[tuple[list[int], set[str]]]:
        """A large batch, in one transaction: ids drawn, unique keys taken, rows copied
        in (far cheaper per row than a statement's arrays), and with ``notify`` one
        NOTIFY per queue with a job ready now. A unique job whose key another job holds
        (an earlier one of the batch, or one already stored) is not copied: its id is
        the holder's, as with the ``enqueue`` statement. Answers the ids and the queues
        with a job ready now."""
        yield Begin()
        try:
            drawn = yield from fetch_one(
                self._q("enqueue_ids"), {"n": len(jobs), "now": self._now()}
            )
            assert drawn is not None  # one row, always
            own = sorted(drawn[0])
            now = float(drawn[1])
            ids = own
            if any(j.unique is not None for j in jobs):
                ids = yield from self._take_keys(jobs, own, now)
            rows = []
            ready: set[str] = set()
            for jid, mine, j in zip(ids, own, jobs, strict=True):
                if jid != mine:
                    continue  # its key's holder is another job: that job is the answer
                run_at = j.run_at if j.run_at is not None else now + (j.delay or 0.0)
                state = "scheduled" if run_at > now else "queued"
                if state == "queued":
                    ready.add(j.queue)
                rows.append(
                    (
                        jid, j.queue, j.task, j.args, j.idempotency_key, j.priority, run_at,
                        j.max_attempts, state, now, now, j.timeout, j.max_lease_expiries,
                    )
                )  # fmt: skip
            yield Copy(self._q("enqueue_copy"), rows, ENQUEUE_COPY_TYPES)
            if ready and notify:
                yield from execute(self._q("enqueue_notify"), self._notify_params(ready))
        except BaseException as exc:
            yield End(exc)
            raise
        yield End()
        return ids, ready

    def _take_keys(self, jobs: Sequence[NewJob], own: list[int], now: float) -> Steps[list[int]]:
        """Take the unique keys of ``jobs`` (whose drawn ids are ``own``) in the
        transaction that copies them in; each job's id: its own, or its key's holder's
        (an earlier job of the batch with the same key, or one already stored)."""
        first: dict[str, tuple[NewJob, int]] = {}
        for j, jid in zip(jobs, own, strict=True):
            if j.unique is not None and j.idempotency_key is not None:
                first.setdefault(j.idempotency_key, (j, jid))
        params = {
            "key": BinaryArray(list(first)),
            "job_id": BinaryArray([jid for _, jid in first.values()]),
            "uniq": BinaryArray([j.unique.value for j, _ in first.values() if j.unique]),
            "unique_for": float_array([j.unique_for for j, _ in first.values()]),
            "now": now,
        }
        # Only the keys held by a job other than the one this batch sent them with.
        held: dict[str, int] = dict((yield from fetch_all(self._q("enqueue_keys"), params)))
        for key, (_, jid) in first.items():
            held.setdefault(key, jid)
        return [
            held[j.idempotency_key] if j.unique is not None and j.idempotency_key else jid
            for j, jid in zip(jobs, own, strict=True)
        ]

    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        """Insert all jobs with one statement and return their ids, in order.

        With ``connection`` (a :class:`psycopg.AsyncConnection` inside the caller's
        transaction, or about to start one) the rows are inserted in that transaction:
        they exist, and workers are notified, if and only if it commits.
        """
        if not jobs:
            return []
        _check_values(jobs)
        if connection is None:
            with self._enqueue_slot() as later:  # see _notifier.py
                if self._copies(jobs):
                    steps = self._enqueue_copy_steps(jobs, notify=later is None)
                    ids, ready = await self._call(
                        lambda conn: AsyncDriver(conn).run(steps), enqueues=len(jobs)
                    )
                else:
                    query, params = self._enqueue_statement(jobs, notify=later is None)
                    rows = await self._tuples(query, params, enqueues=len(jobs))
                    ids, ready = _answered(jobs, rows)
            if later is not None:
                later.add(ready)
            return ids
        query, params = self._enqueue_statement(jobs, notify=True)
        if isinstance(connection, psycopg.Connection):
            # A sync caller (app.enqueue from ordinary code): blocking here is what
            # that caller asked for, on its own connection and thread.
            _require_transaction(connection)
            with self._translate_on_callers_connection():
                cursor = connection.cursor(row_factory=tuple_row).execute(query, params)
                return [row[0] for row in cursor.fetchall()]
        if not isinstance(connection, psycopg.AsyncConnection):
            raise StoreError(
                "connection= must be a psycopg connection to the store's database "
                f"inside an open transaction, not {type(connection).__name__}"
            )
        _require_transaction(connection)
        with self._translate_on_callers_connection():
            cur = connection.cursor(row_factory=tuple_row)
            await cur.execute(query, params)
            return [row[0] for row in await cur.fetchall()]

    def jobs_enqueue_blocking(self, *, jobs: Sequence[NewJob]) -> list[int]:
        """:meth:`jobs_enqueue` on a connection of the blocking pool, in the caller's
        thread (the pool sync handlers' transactions use). Bounded by the store's
        deadline, a server gone silent too (see ``_cutoff.py``)."""
        if not jobs:
            return []
        _check_values(jobs)
        pool, conn = self._checkout_sync()
        try:
            with (
                self._translate(),
                self._cutoffs.arm(conn, self._deadline),
                self._enqueue_slot() as later,  # see _notifier.py
            ):
                if self._copies(jobs):
                    steps = self._enqueue_copy_steps(jobs, notify=later is None)
                    ids, ready = SyncDriver(conn).run(steps)
                elif self._one_alone(jobs) and (
                    answer := self._enqueue_one_direct(conn, jobs[0], notify=later is None)
                ):
                    ids, ready = answer
                else:
                    query, params = self._enqueue_statement(jobs, notify=later is None)
                    cursor = conn.cursor(row_factory=tuple_row).execute(query, params)
                    ids, ready = _answered(jobs, cursor.fetchall())
        except StoreUnavailableError as exc:
            if is_read_only(exc):
                conn.close()  # never to be reused: see _call
            # Checked out: the request was on its way (a failed checkout sent nothing).
            if maybe_made(exc):
                raise enqueue_outcome_unknown(exc, len(jobs)) from exc
            raise
        finally:
            self._checkin_sync(pool, conn)
        if later is not None:
            later.add(ready)
        return ids

    def _enqueue_one_direct(
        self, conn: psycopg.Connection[Any], job: NewJob, *, notify: bool
    ) -> tuple[list[int], set[str]] | None:
        """``enqueue_one`` for ``job`` through the connection's libpq handle (see
        ``_direct.py``): its id and the queues made ready now, or ``None`` when one of
        its values takes psycopg's path (nothing sent then)."""
        statement = self._enqueue_one_raw
        if statement is None:
            # From _q's text on first use: a subclass that rewrites it rewrites this.
            statement = self._enqueue_one_raw = RawStatement.convert(self._q("enqueue_one"))
        params = self._enqueue_one_params(job, notify=notify)
        rows = direct.run(conn, b"tokenline_enqueue_one", statement, params)
        if rows is None:
            return None
        ((jid, ready, _),) = rows
        assert jid is not None  # the jobs table's primary key
        return [int(jid)], {job.queue} if ready == b"t" else set()

    async def wait_for_jobs(
        self,
        *,
        queues: Sequence[str],
        timeout: float,  # noqa: ASYNC109 - the seam's signature
    ) -> None:
        """Return on a NOTIFY for one of ``queues``, or after ``timeout`` seconds."""
        if self._listener is None:
            raise StoreError("the PostgreSQL store is not open; call open() first")
        await self._listener.wait(queues, timeout)

    async def jobs_claim(
        self,
        *,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> list[ClaimedJob]:
        """Lease up to ``limit`` ready jobs to ``owner`` in one statement."""
        if limit <= 0 or not queues:
            return []
        params = self._claim_params(owner, queues, limit, ttl, priority_aging)
        return self._claimed(owner, await self._rows(self._claim_text(limit), params))

    def _claim_text(self, limit: int, *, fused: bool = False, one: bool = False) -> str:
        """The claim statement for ``limit`` jobs, alone or fused with a finish (see
        :func:`fuse_finish_claim`; ``one``: a finish of one job, see :func:`for_one_row`),
        from ``_q``'s texts: a subclass that rewrites those rewrites these too."""
        key = (fused, fused and one, limit if 0 < limit <= LITERAL_CLAIM_LIMIT else 0)
        text = self._claim_texts.get(key)
        if text is None:
            claim = self._q("claim")
            if fused:
                finish = self._q("finish")
                text = fuse_finish_claim(for_one_row(finish) if one else finish, claim)
            else:
                text = claim
            text = self._claim_texts[key] = with_claim_limit(text, limit)
        return text

    def _claim_params(
        self,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None,
    ) -> dict[str, Any]:
        return {
            "owner": owner,
            "queues": list(queues),
            "limit": limit,
            "ttl": ttl,
            "aging": priority_aging,
            "now": self._now(),
        }

    @staticmethod
    def _claimed(owner: str, rows: Sequence[DictRow]) -> list[ClaimedJob]:
        jobs = [job_from_row(r) for r in rows]
        return [
            ClaimedJob(j, Lease(j.id, owner, j.lease_token, j.lease_expires_at or 0.0))
            for j in jobs
        ]

    async def job_leases_renew(
        self, *, owner: str, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | None]:
        """Extend every held lease in one statement; report the lost ones, recording as
        stale those someone else took over."""
        if not leases:
            return []
        params = {
            "job_id": BinaryArray([lease.job_id for lease in leases]),
            "token": BinaryArray([lease.token for lease in leases]),
            "lease_owner": BinaryArray([lease.owner for lease in leases]),
            "owner": owner,
            "ttl": ttl,
            "now": self._now(),
        }
        rows = await self._tuples(self._q("job_leases_renew"), params)
        out: list[Lease | None] = []
        stale: list[Lease] = []
        for lease, (_, expires_at, held_token, held_owner) in zip(leases, rows, strict=True):
            if expires_at is not None:
                out.append(Lease(lease.job_id, owner, lease.token, float(expires_at)))
                continue
            out.append(None)
            if renewal_was_stale(held_token, held_owner, lease.token, owner):
                stale.append(lease)
        if stale:
            await self._rowcount(
                self._q("stale_insert_many"),
                {
                    "job_id": BinaryArray([x.job_id for x in stale]),
                    "token": BinaryArray([x.token for x in stale]),
                    "lease_owner": BinaryArray([x.owner for x in stale]),
                    "operation": "renew",
                    "now": self._now(),
                },
            )
        return out

    async def _finish_on(
        self, conn: AsyncConnection[Any], finishes: Sequence[Finish]
    ) -> list[bool]:
        """Run the fenced batch finish on ``conn``; whether each row was accepted."""
        return await AsyncDriver(conn).run(self._finish_steps(finishes))

    def _finish_steps(self, finishes: Sequence[Finish]) -> Steps[list[bool]]:
        """The fenced batch finish (one statement); whether each row was accepted."""
        rows = yield from fetch_all(*self._finish_statement(finishes))
        return self._accepted(finishes, rows)

    def _finish_statement(self, finishes: Sequence[Finish]) -> tuple[str, dict[str, Any]]:
        """The finish statement for ``finishes`` and its parameters: a batch of one, the
        most common, in the form whose plan the server keeps (see :func:`for_one_row`)."""
        params = self._finish_params(finishes)
        if len(finishes) != 1:
            return self._q("finish"), params
        text = self._finish_one_text
        if text is None:
            text = self._finish_one_text = for_one_row(self._q("finish"))
        return text, _one_row(params)

    def _complete_block_steps(self, finish: Finish) -> Steps[tuple[bool, bool]]:
        """A fenced transaction's end, in one statement: close the block's guard
        (migration 0014) and apply ``finish``. Whether the guard was still there (the
        transaction is the one the block was given) and whether the finish was
        accepted; the caller rolls back unless both."""
        text, params = self._finish_statement([finish])
        guarded = self._guarded_finish_text
        if guarded is None:
            head, last = "WITH ", "SELECT ord FROM done;"
            if not text.startswith(head) or not text.rstrip().endswith(last):
                raise StoreError("the finish statement has changed shape; this is a bug")
            close = self._q("transaction_block_close").rstrip().rstrip(";")
            guarded = self._guarded_finish_text = (
                f"WITH block AS ({close}),\n"
                + text[len(head) : text.rstrip().rindex(last)]
                + "SELECT (SELECT count(*) FROM block), (SELECT count(*) FROM done);"
            )
        row = yield from fetch_one(guarded, params)
        assert row is not None  # two aggregates: always one row
        return bool(row[0]), bool(row[1])

    def _finish_params(self, finishes: Sequence[Finish]) -> dict[str, Any]:
        moves = [finish_transition(f) for f in finishes]
        return {
            "job_id": BinaryArray([f.lease.job_id for f in finishes]),
            "token": BinaryArray([f.lease.token for f in finishes]),
            "lease_owner": BinaryArray([f.lease.owner for f in finishes]),
            "outcome": BinaryArray([f.outcome.value for f in finishes]),
            "state": BinaryArray([m.state.value for m in moves]),
            "delay": float_array([m.delay for m in moves]),
            "refund": BinaryArray([m.refund for m in moves]),
            "final": BinaryArray([m.finished for m in moves]),
            "error": BinaryArray([f.error for f in finishes]),
            "error_class": BinaryArray([f.error_class for f in finishes]),
            "now": self._now(),
        }

    @staticmethod
    def _accepted(finishes: Sequence[Finish], rows: Sequence[TupleRow]) -> list[bool]:
        accepted = {int(r[0]) for r in rows}
        return [n + 1 in accepted for n in range(len(finishes))]

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        """Apply the batch in one statement, each row fenced by its own token."""
        if not finishes:
            return []
        return await self._call(lambda conn: self._finish_on(conn, finishes))

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
        """The fenced finish and the claim in one statement (see :func:`fuse_finish_claim`):
        one round trip, one commit; a failed finish claims nothing."""
        if not finishes or limit <= 0 or not queues:
            return await super().jobs_finish_and_claim(
                finishes=finishes, owner=owner, queues=queues, limit=limit, ttl=ttl,
                priority_aging=priority_aging,
            )  # fmt: skip
        one = len(finishes) == 1
        finish = self._finish_params(finishes)
        params = {
            **(_one_row(finish) if one else finish),
            **self._claim_params(owner, queues, limit, ttl, priority_aging),
        }
        rows = await self._rows(self._claim_text(limit, fused=True, one=one), params)
        accepted = set(rows[0]["finished_ords"] or ())
        done = [n + 1 in accepted for n in range(len(finishes))]
        claimed = [r for r in rows if r["id"] is not None]
        return done, self._claimed(owner, claimed)

    async def _fence_check_on(self, conn: AsyncConnection[Any], lease: Lease) -> bool:
        """Lock the job row if ``lease`` still holds it (inside ``conn``'s transaction)."""
        params = {"job_id": lease.job_id, "token": lease.token, "owner": lease.owner}
        cur = conn.cursor(row_factory=tuple_row)
        await cur.execute(self._q("fence_check"), params)
        return await cur.fetchone() is not None

    def _record_stale_steps(self, lease: Lease, operation: str) -> Steps[None]:
        """Record a refused write of ``lease`` as a stale commit."""
        params = {
            "job_id": lease.job_id,
            "token": lease.token,
            "owner": lease.owner,
            "operation": operation,
            "now": self._now(),
        }
        yield from execute(self._q("stale_insert"), params)

    def _transaction_begin_steps(self, lease: Lease, open_for: float | None) -> Steps[bool]:
        """The first statement of a fenced transaction: whether ``lease`` holds the job
        (see ``transaction_begin`` in queries.sql). ``open_for``: seconds the
        transaction, and each of its statements, may last (else the store timeout)."""
        params = {
            "job_id": lease.job_id,
            "token": lease.token,
            "owner": lease.owner,
            "session": self.session_name(lease),
            "timeout_ms": None if open_for is None else str(max(1, round(open_for * 1000))),
        }
        return (yield from fetch_one(self._q("transaction_begin"), params)) is not None

    def session_name(self, lease: Lease) -> str:
        """The ``application_name`` of a fenced transaction of the attempt holding
        ``lease``: unique per schema, job and token, under PostgreSQL's 63 bytes."""
        return f"tokenline {self._schema_tag} {lease.job_id}.{lease.token}"

    async def jobs_rescue(
        self, *, limit: int = 1000, leader: ResourceLease | None = None
    ) -> RescueReport:
        """Requeue or dead-letter running jobs whose lease expired by the store's clock,
        as the core decides, then end the fenced transactions those attempts left open;
        only if ``leader`` (when given) still holds the maintenance lease.

        An expired job whose row its attempt's transaction still locks (paused between
        its completion and its commit) is skipped, and that session ended: the next
        rescue takes the job."""
        blocked: list[Lease] = []

        async def run(conn: AsyncConnection[Any]) -> list[TupleRow]:
            cur = conn.cursor(row_factory=tuple_row)
            async with conn.transaction():
                await check_leader(cur, self._q("leader_holds"), leader, "rescue", self._now())
                await cur.execute(
                    self._q("rescue_candidates"), {"limit": limit, "now": self._now()}
                )
                candidates = [RescueCandidate(*row) for row in await cur.fetchall()]
                if len(candidates) < limit:
                    taken = [c.job_id for c in candidates]
                    await cur.execute(
                        self._q("rescue_blocked"),
                        {"limit": limit, "now": self._now(), "taken": taken},
                    )
                    blocked[:] = [Lease(r[0], "", r[1], 0.0) for r in await cur.fetchall()]
                if not candidates:
                    return []
                rescues = [rescue_transition(c) for c in candidates]
                moves = [r.transition for r in rescues]
                params = {
                    "job_id": BinaryArray([c.job_id for c in candidates]),
                    "token": BinaryArray([c.token for c in candidates]),
                    "state": BinaryArray([m.state.value for m in moves]),
                    "refund": BinaryArray([m.refund for m in moves]),
                    "final": BinaryArray([m.finished for m in moves]),
                    "delay": float_array([m.delay for m in moves]),
                    "error": BinaryArray([r.reason for r in rescues]),
                    "now": self._now(),
                    "channel": self.target.channel,
                }
                await cur.execute(self._q("rescue"), params)
                return await cur.fetchall()

        rows = await self._call(run)
        ended = [Lease(r[0], "", r[2], 0.0) for r in rows] + blocked
        if ended:
            await self._end_sessions([self.session_name(lease) for lease in ended])
        return RescueReport(
            requeued=[r[0] for r in rows if r[1] == JobState.QUEUED],
            dead=[r[0] for r in rows if r[1] == JobState.DEAD],
        )

    async def end_attempt_sessions(self, attempts: Sequence[tuple[int, int]]) -> None:
        """End the open fenced transactions of the attempts ``(job id, token)``, whose
        leases another role (the split topology's Redis) found expired; best effort,
        as after this store's own rescue."""
        await self._end_sessions(
            [self.session_name(Lease(job_id, "", token, 0.0)) for job_id, token in attempts]
        )

    async def _end_sessions(self, sessions: list[str]) -> None:
        """Terminate the named sessions, best effort: without the right to (another
        role's sessions), they end at their own timeout, and nothing is unsafe."""
        try:
            rows = await self._tuples(self._q("sessions_terminate"), {"sessions": sessions})
        except StoreError as exc:
            log.warning("could not end the open transactions of expired attempts: %s", exc)
            return
        if rows and rows[0][0]:
            log.warning("ended %d open transactions of attempts whose lease expired", rows[0][0])

    # -- queues ---------------------------------------------------------------------------
    async def queue_pause(self, *, queue: str) -> None:
        """Stop claims from ``queue``."""
        await self._rowcount(self._q("pause"), {"queue": queue, "now": self._now()})

    async def queue_resume(self, *, queue: str) -> None:
        """Allow claims from ``queue`` again, and wake its idle workers."""
        await self._tuples(self._q("resume"), {"queue": queue, "channel": self.target.channel})

    async def queues_stats(self) -> list[QueueStats]:
        """Per-queue counts by state, oldest ready age and paused flag."""

        async def run(conn: AsyncConnection[Any]) -> list[list[TupleRow]]:
            cur = conn.cursor(row_factory=tuple_row)
            out = []
            for name, params in (
                ("stats_counts", None),
                ("stats_oldest", {"now": self._now()}),
                ("paused_list", None),
            ):
                await cur.execute(self._q(name), params)
                out.append(await cur.fetchall())
            return out

        count_rows, oldest_rows, paused_rows = await self._call(run)
        counts: dict[str, dict[str, int]] = {}
        for queue, state, n in count_rows:
            counts.setdefault(queue, {})[state] = n
        oldest: dict[str, float] = dict(oldest_rows)
        paused = {row[0] for row in paused_rows}
        return [
            QueueStats(q, counts.get(q, {}), oldest.get(q), q in paused)
            for q in sorted(set(counts) | paused)
        ]

    async def jobs_depth(self) -> list[Depth]:
        """Unfinished jobs per queue, task and state: one grouped read."""
        rows = await self._rows(self._q("jobs_depth"), {"now": self._now()})
        return [Depth(r["queue"], r["task"], r["depth_state"], r["n"]) for r in rows]

    # -- inspection -----------------------------------------------------------------------
    async def job_get(self, *, job_id: int) -> Job:
        """The job, or :class:`JobNotFoundError`."""
        if not possible_job_id(job_id):
            raise JobNotFoundError(f"no job with id {job_id}")
        rows = await self._rows(self._q("job_get"), {"job_id": job_id})
        if not rows:
            raise JobNotFoundError(f"no job with id {job_id}")
        return job_from_row(rows[0])

    async def jobs_list(
        self,
        *,
        state: JobState | None = None,
        queue: str | None = None,
        limit: int = 100,
        args_limit: int | None = None,
    ) -> list[Job]:
        """Jobs filtered by state and queue, newest first (``args`` cut to ``args_limit``)."""
        params = {
            "state": state.value if state else None,
            "queue": queue,
            "limit": limit,
            "args_limit": args_limit,
        }
        return [job_from_row(r) for r in await self._rows(self._q("jobs_list"), params)]

    async def job_attempts(self, *, job_id: int) -> list[Attempt]:
        """Attempts of the job, oldest first."""
        await self.job_get(job_id=job_id)
        rows = await self._rows(self._q("attempts_list"), {"job_id": job_id})
        return [attempt_from_row(r) for r in rows]

    async def jobs_retry_dead(self, *, job_ids: Sequence[int]) -> int:
        """Requeue dead jobs with a fresh budget of their own ``max_attempts``."""
        ids = possible_job_ids(job_ids)
        params = {"ids": ids, "now": self._now(), "channel": self.target.channel}
        ((n,),) = await self._tuples(self._q("retry_dead"), params)
        return int(n)

    async def jobs_cancel(self, *, job_ids: Sequence[int], reason: str) -> int:
        """Cancel queued, scheduled or dead jobs."""
        params = {"ids": possible_job_ids(job_ids), "reason": reason, "now": self._now()}
        return await self._rowcount(self._q("cancel"), params)

    async def stale_commits(self, *, limit: int = 100) -> tuple[int, list[StaleCommit]]:
        """Total refused writes and the most recent ``limit``."""

        async def run(conn: AsyncConnection[Any]) -> tuple[int, list[TupleRow]]:
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(self._q("stale_count"))
            ((total,),) = await cur.fetchall()
            await cur.execute(self._q("stale_list"), {"limit": limit})
            return int(total), await cur.fetchall()

        total, rows = await self._call(run)
        return total, [StaleCommit(*r) for r in rows]

    # -- workers and leases ---------------------------------------------------------------
    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        """Register (or re-register) a worker with a fresh membership token."""
        params = {
            "id": record.id,
            "host": record.host,
            "pid": record.pid,
            "queues": list(record.queues),
            "concurrency": record.concurrency,
            "state": record.state,
            "ttl": ttl,
            "concurrency_limit": record.concurrency_limit,
            "now": self._now(),
        }
        (row,) = await self._rows(self._q("worker_register"), params)
        return worker_from_row(row)

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
        """Extend the membership lease; ``None`` if it was lost."""
        params = {
            "id": worker_id,
            "token": token,
            "state": state,
            "in_flight": in_flight,
            "ttl": ttl,
            "skew": skew,
            "concurrency_limit": concurrency_limit,
            "now": self._now(),
        }
        rows = await self._rows(self._q("worker_heartbeat"), params)
        return worker_from_row(rows[0]) if rows else None

    async def store_time(self) -> float:
        """The database's clock (``statement_timestamp()``), or the injected one."""
        rows = await self._tuples(self._q("store_time"), {"now": self._now()})
        return float(rows[0][0])

    async def worker_deregister(self, *, worker_id: str, token: int) -> None:
        """Mark the worker stopped."""
        params = {"id": worker_id, "token": token, "now": self._now()}
        await self._rowcount(self._q("worker_deregister"), params)

    async def workers_list(self) -> list[WorkerRecord]:
        """All workers, newest first."""
        return [worker_from_row(r) for r in await self._rows(self._q("workers_list"), {})]

    async def worker_drain(self, *, worker_id: str) -> bool:
        """Mark the worker's live membership as asked to drain."""
        params = {"id": worker_id, "now": self._now()}
        return await self._rowcount(self._q("worker_drain"), params) == 1

    async def resource_lease_acquire(
        self, *, resource: str, owner: str, ttl: float
    ) -> ResourceLease | None:
        """Take, or renew, the named lease."""
        params = {"resource": resource, "owner": owner, "ttl": ttl, "now": self._now()}
        rows = await self._tuples(self._q("resource_lease_acquire"), params)
        return ResourceLease(*rows[0]) if rows else None

    async def resource_lease_release(self, *, lease: ResourceLease) -> bool:
        """Release the named lease if ``(owner, token)`` still holds it."""
        params = {
            "resource": lease.resource,
            "owner": lease.owner,
            "token": lease.token,
            "now": self._now(),
        }
        return await self._rowcount(self._q("resource_lease_release"), params) == 1

    async def resource_leases_list(self) -> list[ResourceLease]:
        """Every named lease, held or not, by resource name."""
        rows = await self._tuples(self._q("resource_leases_list"), {})
        return [ResourceLease(*r) for r in rows]

    # -- transactions ---------------------------------------------------------------------
    def fenced_transaction(
        self, *, lease: Lease, fences: Sequence[Fence] = (), timeout: float | None = None
    ) -> FencedTransaction:
        """A transaction (``with``: a :class:`psycopg.Connection`; ``async with``: a
        :class:`psycopg.AsyncConnection`) that checks ``lease`` first, advances ``fences``
        and completes the job on commit; see
        :class:`~tokenline.stores.postgres.PostgresFencedTransaction`. ``timeout``: how
        long it may stay open (the attempt's remaining time), instead of the store's."""
        return PostgresFencedTransaction(self, lease, fences, timeout)


def _require_transaction(connection: psycopg.Connection[Any] | AsyncConnection[Any]) -> None:
    """Refuse a connection whose inserts would commit on their own, or that is closed."""
    if connection.closed:
        raise StoreError(
            "connection= is closed: enqueue on an open connection, inside its transaction"
        )
    status = connection.info.transaction_status
    in_transaction = status == TransactionStatus.INTRANS or (
        status == TransactionStatus.IDLE and not connection.autocommit
    )
    if not in_transaction:
        raise StoreError(
            "connection= must be inside an open transaction (conn.transaction(), or a "
            "connection without autocommit): otherwise the jobs would commit on their own"
        )
