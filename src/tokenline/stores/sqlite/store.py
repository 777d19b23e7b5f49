"""SQLite store: WAL mode, two files, safe for several processes on one machine.

**Two files.** ``tokenline.db`` holds the jobs, their attempts and the ledger — and the
user's own tables written through ``ctx.transaction()``. ``tokenline.db-coord`` holds
what every renewal tick rewrites: job lease expiries, worker membership, resource
lease holders, and the clock anchor (``coord.sql``). SQLite lets one writer at a time
hold a file; with leases in their own file, a handler's transaction that keeps the main
file locked for a long time cannot hold up any renewal, of its own worker or any other.

**Why a stale worker still cannot commit.** Ownership of a job is its token, in the
main file. A claim bumps it, a rescue bumps it, and every completion, retry and ledger
write is ``… WHERE lease_token = ? AND lease_owner = ? AND state = 'running'`` under the
main file's write lock. The coordination file only says whether a lease is still alive:

* a claim writes (and commits) the new lease rows *before* committing the claim in the
  main file, while it holds the main file's write lock; so whoever sees a job running
  sees its lease row, and a row never gives way to a lower token;
* a renewal extends a row only while its token and owner match and it has not expired:
  an expired lease stays expired, so a rescuer that saw it expired was right;
* the rescue runs under the main file's write lock, reads the leases from a snapshot
  taken after that lock (every committed claim's row is in it), and bumps the token of
  each running job without a live row — conditional on that token, as ever.

A lease row that is lost, or never written (a process killed between the two commits),
reads as expired: the job is rescued, which is what its dead claimer needs.

**One clock.** Every time this store compares or stores is its own clock
(``_clock.py``): one clock for all processes of the machine, anchored once per boot in
the coordination file, immune to steps of the wall clock and to a process's faked time.
It is read once the transaction holds its write lock, never before: a call that waited
for the lock must not hand out a lease that the wait has already aged.

**Threads.** Calls on the main file run on one thread per process, calls on the
coordination file on another, so a renewal never queues behind a claim or a finish
that waits for the main file's lock. While one of this process's own fenced
transactions holds that lock, main-file calls wait for it instead of reporting the
store unavailable: the lock holder is alive, and it is us. A blocking enqueue from
ordinary code is the exception: it writes on the caller's own thread, with a
connection of its own (``_callers.py``). ``synchronous=NORMAL`` in
WAL mode survives a crash of any process (kill -9); only an operating system crash or
power loss can drop the last commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..._clock import Clock
from ..._errors import (
    JobNotFoundError,
    SchemaVersionError,
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
    claim_key,
    finish_transition,
    rescue_transition,
)
from ..._records import Fence
from .._rows import attempt_from_row, job_from_row
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
from ._callers import (
    CallerConnections,
    held_by_this_task,
    held_by_this_thread,
    own_lock_refused,
)
from ._catalog import (
    COORD,
    MAIN,
    check_objects,
    check_version,
    version_and_tables,
    version_lost,
)
from ._claim import claim_candidates
from ._clock import Anchor, MachineClock, Uptime, WallClock, boot_id
from ._connection import (
    Connection,
    attach_coord,
    connect_coord,
    connect_main,
    coord_path,
    immediate,
    set_busy_timeout,
    statements,
)
from ._errors import SQLiteBusyError, map_sqlite_errors
from ._lanes import Begun, Here, Lane, Writers
from .leases import SQLiteLeases
from .ledger import LQ, SQLiteLedger, insert_job
from .maintenance import SQLiteMaintenance, check_leader
from .retention import SQLiteRetention

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

log = logging.getLogger("tokenline.store.sqlite")

SCHEMA_VERSION = 7
Q = load_queries(__name__.rpartition(".")[0])
CQ = load_queries(__name__.rpartition(".")[0], "coord.sql")
#: Version of the coordination file's schema (its own ``user_version``).
COORD_VERSION = 4
T = TypeVar("T")
#: The connections a main-lane call gets: the main file's, and a coordination one.
Conns = tuple[sqlite3.Connection, ...]

#: Lease rows expired longer than this are pruned by the rescue.
_PRUNE_AFTER = 60.0
#: The main connection's own busy wait, per try (see SQLiteStore._on_main).
_POLL = 0.05
#: Rows the event loop's connections (see _on_main) write between two checkpoints of
#: the write-ahead logs. SQLite's own checkpoint writes pages back to the file and
#: fsyncs it, inside the committing call: on the event loop it must not. Those
#: connections never checkpoint themselves; the lane's thread does it instead, about
#: as often as WAL_AUTOCHECKPOINT pages would (a job's enqueue, claim and finish write
#: 5 rows and about 17 pages, when each is its own transaction).
_CHECKPOINT_ROWS = 2_500
#: A write-ahead log larger than this has its checkpoint made to start it again from
#: its beginning (RESTART, waiting briefly for readers), and seconds between two looks
#: at its size. A passive checkpoint copies the log into the file but cannot start it
#: again while any other connection reads from it, which, with several worker
#: processes at work, is always: the log grew by the whole run (hundreds of MB).
_WAL_RESTART_BYTES = 40 * 1024 * 1024
_WAL_LOOK_EVERY = 0.25
#: A RESTART kept from copying the whole log by a reader of an old snapshot (a long
#: read, an outside tool's open transaction) is tried again after twice as long as the
#: last time, from this, up to :data:`_WAL_LOOK_MAX`: each try holds this process's
#: calls, and other processes' writes, for its wait.
_WAL_BACKOFF_MIN = 0.5
_WAL_LOOK_MAX = 2.0
#: What a call on the event loop's thread answers when it would have had to wait.
_BUSY = object()
#: Calls of up to this many jobs may run on the event loop's thread (see _on_main):
#: about a millisecond of SQLite's time at most, as short as a claim's round trip to
#: the lane's thread and back; bigger ones go to the lane.
_HERE_MAX_ROWS = 64


def _too_big(path: Path) -> bool:
    """Whether the write-ahead log of ``path`` has grown past :data:`_WAL_RESTART_BYTES`."""
    try:
        return os.stat(f"{path}-wal").st_size > _WAL_RESTART_BYTES
    except OSError:  # not there: nothing written since it was last cut
        return False


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
    path = Path(raw)
    if path.name in ("", ".", ".."):
        raise StoreError(
            f"{url!r} names a directory, not a file: name a file in it (sqlite:///path/to/file.db)"
        )
    # The longest name the store writes beside the file is its coordination file's
    # log: a file name the filesystem takes could still fail there, mid-way.
    longest = len(os.fsencode(f"{path.name}-coord-wal"))
    limit = _name_max(path.parent)
    if longest > limit:
        raise StoreError(
            f"the file name in {url!r} is {len(os.fsencode(path.name))} bytes long; the "
            f"store keeps files named after it with up to {longest - len(os.fsencode(path.name))} "
            f"bytes more ('-coord-wal'), and this filesystem takes names of at most {limit}: "
            "give a shorter name"
        )
    return path


def _name_max(directory: Path) -> int:
    """The longest file name the filesystem of ``directory`` (or of its nearest parent
    that exists) takes, in bytes; 255, the usual one, where it cannot be asked."""
    for place in (directory, *directory.parents):
        try:
            return os.pathconf(place if str(place) else ".", "PC_NAME_MAX")
        except (OSError, ValueError):
            continue
    return 255


def _job(row: sqlite3.Row) -> Job:
    """A job row joined with its live lease expiry from the coordination file."""
    job = job_from_row(row)
    live = row["live_expires_at"]
    if job.state is JobState.RUNNING and live is not None and live != job.lease_expires_at:
        return dataclasses.replace(job, lease_expires_at=live)
    return job


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


@contextlib.contextmanager
def _version_trusted(path: Path, version: int) -> Iterator[None]:
    """Around a migration from ``version``: a step that finds what it makes already
    there says that the file's user_version is lower than its tables (set by hand or
    by another application), not that the file is broken. Nothing was changed: the
    migration's transaction rolls back."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if "duplicate column" in str(exc) or "already exists" in str(exc):
            raise version_lost(path, version) from exc
        raise


class SQLiteStore(SQLiteMaintenance, SQLiteRetention, SQLiteLeases, SQLiteLedger, Store):
    """A store in one SQLite file and its coordination file (``sqlite:///path.db``).

    ``clock`` replaces the store's own clock (tests); by default it is the machine's
    clock anchored in the coordination file (see ``_clock.py``). ``migrate=False``: a
    missing or outdated schema (either file's) is refused on open with a hint to run
    ``tokenline migrate``, and no file is created or changed; :meth:`migrate` still
    migrates.
    """

    capabilities = Capabilities(
        multi_process=True,
        transactional_completion=True,
        ledger=True,
        ledger_waits_for_transaction=True,
        lease_waits_for_transaction=True,
        blocking_enqueue=True,
    )

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        timeout: float = 10.0,
        migrate: bool = True,
    ) -> None:
        self.path = path_from_url(url)
        #: Create or upgrade the schemas when opened (see the class docstring).
        self.migrate_on_open = migrate
        #: Whether this opening may create or upgrade them (:meth:`migrate` says yes).
        self._migrating = migrate
        # (Store.migrated: the main file's versions; an upgrade of the -coord file alone
        # shows as the same version before and after.)
        self.migrated = None
        self.coord_path = coord_path(self.path)
        self._given_clock = clock
        #: The store's clock; the machine's, anchored at :meth:`open`, unless given.
        self.clock: Any = clock or WallClock()
        self.timeout = timeout
        self._main: Lane | None = None
        self._coord: Lane | None = None
        self._callers: CallerConnections | None = None
        self._file = ""  # the resolved path, once open
        self._uptime: Uptime | None = None
        self._writers = Writers()
        self._async_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._pending: set[asyncio.Task[None]] = set()
        #: Connections for calls on the event loop's thread (see _on_main).
        self._here: Here | None = None
        #: Rows those connections had written at the last checkpoint.
        self._checkpointed = 0
        self._checkpointing = False
        #: When the logs' sizes were last looked at (the event loop's monotonic clock),
        #: and how long until the next look.
        self._wal_looked = 0.0
        self._wal_wait = _WAL_LOOK_EVERY
        #: RESTART checkpoints tried, and those a reader kept from finishing.
        self.wal_restarts = [0, 0]
        # SQLite's busy timeout (``timeout``) ends a wait for a lock first; this is the
        # last resort against a thread that stops answering (see Lane).
        self._deadline = 2 * timeout + 1

    # -- plumbing -------------------------------------------------------------------------
    def _lane(self, lane: Lane | None) -> Lane:
        if lane is None or not lane.conns:
            raise StoreError("the SQLite store is not open; call open() first")
        return lane

    async def _call(self, fn: Callable[[sqlite3.Connection], T], *, here: bool = False) -> T:
        """Run ``fn`` on the main connection (main file, leases read-only); ``here``: see
        :meth:`_on_main`."""
        return await self._on_main(lambda conns: fn(conns[0]), here=here)

    async def _call_both(
        self, fn: Callable[[sqlite3.Connection, sqlite3.Connection], T], *, here: bool = False
    ) -> T:
        """Run ``fn`` with the main connection and the main thread's coordination
        connection (to write leases inside a main-file transaction); ``here``: see
        :meth:`_on_main`."""
        return await self._on_main(lambda conns: fn(conns[0], conns[1]), here=here)

    async def _on_main(self, call: Callable[[Conns], T], *, here: bool = False) -> T:
        """Run ``call`` with a main connection and a coordination connection, on the
        main lane's thread.

        ``here``: first try it on the event loop's own thread, with connections of its
        own that never wait (:class:`Here`): if another connection holds a lock it needs
        — another process's, or this lane's — SQLite answers "busy" at once, the call's
        transaction rolls back, and the call goes to the lane, which waits. Only for
        calls that are one short transaction, so that a busy error leaves nothing done.
        The round trip to the lane's thread and back cost more than a claim.
        """
        if here:
            # A turn of the loop first, as a call on the lane gives: a caller that makes
            # these calls one after another must not starve the loop's other tasks.
            await asyncio.sleep(0)
        # Looked up after that turn: the store may have been closed meanwhile.
        lane = self._lane(self._main)
        here_conns = self._here
        # While the lane checkpoints, calls queue behind it: a checkpoint that ran beside
        # writes on the event loop's connections never caught up with them, and the log
        # was never written again from its start (see _checkpoint_if_due).
        if here and here_conns is not None and not self._checkpointing:
            ran, result = here_conns.run(lambda conns: self._at_once(conns, call))
            if ran and result is not _BUSY:
                self._checkpoint_if_due(here_conns)
                return result  # type: ignore[return-value]
        return await lane.call(
            self._waiting(lambda: call(lane.conns)),
            deadline=self._deadline,
            keep_waiting=self._writers.held_since,
            path=self.path,
        )

    def _at_once(self, conns: Conns, call: Callable[[Conns], T]) -> T | object:
        """``call(conns)`` on connections that never wait; ``_BUSY`` if a lock it needs
        is held (nothing was done)."""
        try:
            with map_sqlite_errors(self.path):
                return call(conns)
        except SQLiteBusyError:
            return _BUSY

    def _checkpoint_if_due(self, here: Here) -> None:
        """Have the lane checkpoint both write-ahead logs once the event loop's
        connections have written ``_CHECKPOINT_ROWS`` rows since the last time: they
        never checkpoint on their own, which would write pages back to the files and
        fsync them on the event loop."""
        if self._checkpointing:
            return
        written = sum(conn.total_changes for conn in here.conns)
        due = written - self._checkpointed >= _CHECKPOINT_ROWS
        restart: tuple[bool, ...] = (False, False)
        now = time.monotonic()
        if now - self._wal_looked >= self._wal_wait:
            self._wal_looked = now
            restart = tuple(_too_big(p) for p in (self.path, self.coord_path))
        if not due and not any(restart):
            return
        self._checkpointed = written
        self._checkpointing = True
        lane = self._lane(self._main)

        def run(abandoned: Callable[[], bool]) -> bool:
            """Checkpoint both logs; whether a RESTART was kept from finishing."""
            kept = False
            for conn, schema, big in zip(lane.conns, ("main", "coord"), restart, strict=True):
                if not big:
                    conn.execute(f"PRAGMA {schema}.wal_checkpoint(PASSIVE)")
                    continue
                # Waiting for the readers briefly, as a claim waits for a lock: the
                # calls of this process queue behind it meanwhile.
                before = conn.busy_ms if isinstance(conn, Connection) else None
                set_busy_timeout(conn, round(_POLL * 1000))
                try:
                    row = conn.execute(f"PRAGMA {schema}.wal_checkpoint(RESTART)").fetchone()
                finally:
                    if before is not None:
                        set_busy_timeout(conn, before)
                # (busy, frames in the log, frames copied): kept from finishing by a
                # reader of an old snapshot, which keeps frames from being copied. A
                # reader of the newest one only was there at the wrong moment.
                kept = kept or (row is not None and row[0] != 0 and row[2] < row[1])
            return kept

        async def checkpoint() -> None:
            try:
                with map_sqlite_errors(self.path):
                    kept = await lane.call(run, deadline=self._deadline, path=self.path)
                if any(restart):
                    self.wal_restarts[0] += 1
                    self.wal_restarts[1] += kept
                    if kept:
                        self._wal_wait = min(
                            max(2 * self._wal_wait, _WAL_BACKOFF_MIN), _WAL_LOOK_MAX
                        )
                    else:
                        self._wal_wait = _WAL_LOOK_EVERY
            except StoreError as exc:
                log.debug("checkpoint of %s not done: %s", str(self.path), exc)
            finally:
                self._checkpointing = False

        task = asyncio.ensure_future(checkpoint())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _waiting(self, call: Callable[[], T]) -> Callable[[Callable[[], bool]], T]:
        def run(abandoned: Callable[[], bool]) -> T:
            # The connection's own busy wait is short (_POLL): the wait for another
            # connection's lock is this loop, so that it can end as soon as its caller
            # gives up. A busy error leaves nothing done: the write lock is taken first.
            began = time.monotonic()
            while True:
                tried = time.monotonic()
                try:
                    with map_sqlite_errors(self.path):
                        return call()
                except SQLiteBusyError as exc:
                    # Known, not hoped: an operator's command that fails here says that
                    # its change was not made, rather than that it may have been.
                    exc.changed_nothing = True
                    if abandoned():
                        raise
                    # One of our own transactions holds the lock: it is alive (it is
                    # us), so wait for it rather than fail.
                    if self._writers.held_since(tried):
                        continue
                    if time.monotonic() - began < self.timeout:
                        continue
                    raise

        return run

    async def _coord_call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` on the coordination thread (never behind a main-file call)."""
        lane = self._lane(self._coord)

        def run(abandoned: Callable[[], bool]) -> T:
            with map_sqlite_errors(self.coord_path):
                return fn(lane.conns[0])

        return await lane.call(run, deadline=self._deadline, path=self.coord_path)

    def _later(self, fn: Callable[[sqlite3.Connection], object]) -> None:
        """Record something in the main file without making the caller wait for its
        lock (a refused renewal's audit row); :meth:`_flush` waits for them."""

        async def record() -> None:
            try:
                await self._call(fn)
            except StoreError as exc:
                log.warning("could not record a refused write: %s", exc)

        task = asyncio.ensure_future(record())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _flush(self) -> None:
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    _write = staticmethod(immediate)

    def _q(self, name: str) -> str:
        """The query ``name`` of the main or the coordination file."""
        return Q[name] if name in Q else CQ[name]

    # -- life cycle -----------------------------------------------------------------------
    async def open(self) -> None:
        """Open both files (creating them and their schemas if new), check the schema
        version and anchor the clock."""
        if self._main is not None:
            return
        parent = self.path.parent
        if not parent.is_dir():
            raise StoreUnavailableError(
                f"cannot open SQLite store {str(self.path)!r}: "
                f"directory {str(parent)!r} does not exist"
            )
        self._refuse_directories()
        main, coord = Lane("tokenline-sqlite"), Lane("tokenline-sqlite-coord")
        try:
            main.conns = await main.run(lambda: self._while_busy(self._open_main))
            coord.conns = await coord.run(self._open_coord)
            here = Here(await main.run(lambda: self._while_busy(self._open_here)))
        except BaseException:
            for lane in (main, coord):
                lane.close()
            if self._uptime is not None:
                self._uptime.close()
                self._uptime = None
            raise
        self._main, self._coord, self._here = main, coord, here
        self._file = str(self.path.resolve())
        self._callers = CallerConnections(self._connect_caller)

    def _refuse_directories(self) -> None:
        """Refuse a store whose file, or coordination file, is a directory."""
        for path in (self.path, self.coord_path):
            if path.is_dir():
                # SQLite says only "unable to open database file", and its hint would
                # send the operator to the directory's permissions.
                raise StoreUnavailableError(
                    f"cannot open SQLite store {str(self.path)!r}: {str(path)!r} is a "
                    "directory, not a file: name a file in the URL"
                )

    def _connect_caller(self) -> sqlite3.Connection:
        """A main-file connection for a synchronous caller's thread (see _callers.py);
        its lock waits are short turns of :meth:`_waiting`, as on the store's thread.
        It runs nothing but :meth:`_enqueue_on`'s write transactions."""
        with map_sqlite_errors(self.path):
            return connect_main(self.path, busy_timeout=_POLL, same_thread=False, writes_only=True)

    def _while_busy(self, fn: Callable[[], T]) -> T:
        """``fn()``, tried again while the file is busy, for up to the store timeout.

        Processes that open a new file at the same moment race to switch it to WAL and
        to create its schema; SQLite answers the losers "busy" at once, without waiting
        for the winner, whose work then makes theirs unnecessary.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return fn()
            except SQLiteBusyError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_POLL)

    def _too_old(self, path: Path, version: int) -> SchemaVersionError:
        """The one case that applies: the file is missing (nothing was created), or its
        schema is older than the one this tokenline needs; migrations are off."""
        coord = path == self.coord_path
        what = f"the store's coordination file {str(path)!r}" if coord else repr(str(path))
        off = (
            "migrations are off (TOKENLINE_MIGRATE=0, migrate=False, or a command that "
            "reads or acts on a store and never upgrades it)"
        )
        if not path.exists():
            return SchemaVersionError(
                f"{what} does not exist and {off}, so nothing was created: run "
                "`tokenline migrate` to create it, or allow migrations"
            )
        needed = COORD_VERSION if coord else SCHEMA_VERSION
        state = "holds no tokenline schema" if version == 0 else f"has schema version {version}"
        return SchemaVersionError(
            f"{what} {state}; this tokenline needs schema version {needed} and {off}: run "
            "`tokenline migrate`, or allow migrations"
        )

    def _open_main(self) -> tuple[sqlite3.Connection, sqlite3.Connection]:
        # Without migrations, refused before connecting: a connection would create the
        # file. The main file first, and read before the coordination file is looked
        # for: a main file that is no store at all is what to say then.
        if not self._migrating and (not self.path.is_file() or self.path.stat().st_size == 0):
            raise self._too_old(self.path, 0)
        with map_sqlite_errors(self.path):
            conn = connect_main(self.path, busy_timeout=self.timeout)
            try:
                # Before anything is changed (WAL is a change to the file's header).
                check_version(conn, self.path)
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"cannot switch {str(self.path)!r} to WAL (got {mode})")
                self._migrate(conn)
            except BaseException:
                conn.close()
                raise
        if not self._migrating and (
            not self.coord_path.is_file() or self.coord_path.stat().st_size == 0
        ):
            conn.close()
            raise self._too_old(self.coord_path, 0)
        with map_sqlite_errors(self.coord_path):
            try:
                coord = connect_coord(self.coord_path, busy_timeout=self.timeout)
            except BaseException:
                conn.close()
                raise
            try:
                mode = coord.execute("PRAGMA coord.journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"cannot switch {str(self.coord_path)!r} to WAL")
                self._migrate_coord(coord)
                self.clock = self._anchor(coord)
                attach_coord(conn, self.coord_path, readonly=True)
                # Migrations waited the whole store timeout for the lock; from now on
                # _on_main waits in short turns, so that a wait can be given up.
                set_busy_timeout(conn, round(_POLL * 1000))
            except BaseException:
                conn.close()
                coord.close()
                raise
        return conn, coord

    def _open_here(self) -> Conns:
        """The event loop's connections (see _on_main): a main one with the coordination
        file attached read-only, and a coordination one, neither waiting for a lock nor
        checkpointing on its own once open. Opening them waits as any opening does:
        other processes may be creating the same new file at this moment."""
        conns: list[sqlite3.Connection] = []
        try:
            with map_sqlite_errors(self.path):
                conns.append(
                    connect_main(
                        self.path,
                        busy_timeout=self.timeout,
                        same_thread=False,
                        coord=self.coord_path,
                    )
                )
                conns.append(
                    connect_coord(self.coord_path, busy_timeout=self.timeout, same_thread=False)
                )
                for conn in conns:
                    conn.execute("PRAGMA wal_autocheckpoint = 0")
                    set_busy_timeout(conn, 0)
        except BaseException:
            for conn in conns:
                conn.close()
            raise
        return tuple(conns)

    def _open_coord(self) -> tuple[sqlite3.Connection]:
        with map_sqlite_errors(self.coord_path):
            return (connect_coord(self.coord_path, busy_timeout=self.timeout),)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version, ours = version_and_tables(conn)
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{str(self.path)!r} has schema version {version}, newer than this "
                f"tokenline's {SCHEMA_VERSION}: upgrade tokenline"
            )
        if version == SCHEMA_VERSION:
            # The version says which migrations ran, not that what they made is there.
            check_objects(conn, "main", self.path, MAIN, version)
            return
        if version == 0 and ours:
            raise version_lost(self.path, version)
        if not self._migrating:
            raise self._too_old(self.path, version)
        # Schema and version in one transaction: a crash (or a failing statement) leaves
        # the file as it was; a concurrent starter waits for the lock, then finds it done.
        with self._write(conn), _version_trusted(self.path, version):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version >= SCHEMA_VERSION:
                return
            steps = [
                (0, Q["schema"]),
                (1, LQ["schema_v2"]),
                (2, Q["schema_v3"]),
                (3, Q["schema_v4"]),
                (4, Q["schema_v5"]),
                (5, Q["schema_v6"]),
                (6, Q["schema_v7"]),
            ]
            for since, script in steps:
                if version <= since:
                    for statement in statements(script):
                        conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")
        check_objects(conn, "main", self.path, MAIN, SCHEMA_VERSION)
        self.migrated = (version, SCHEMA_VERSION)

    def _migrate_coord(self, coord: sqlite3.Connection) -> None:
        version = coord.execute("PRAGMA coord.user_version").fetchone()[0]
        if version > COORD_VERSION:
            raise SchemaVersionError(
                f"{str(self.coord_path)!r} has schema version {version}, newer than this "
                f"tokenline's {COORD_VERSION}: upgrade tokenline"
            )
        if version == COORD_VERSION:
            check_objects(coord, "coord", self.coord_path, COORD, version)
            return
        if not self._migrating:
            raise self._too_old(self.coord_path, version)
        with immediate(coord):
            version = coord.execute("PRAGMA coord.user_version").fetchone()[0]
            if version >= COORD_VERSION:
                return
            steps = [
                (0, CQ["schema"]),
                (1, CQ["schema_v2"]),
                (2, CQ["schema_v3"]),
                (3, CQ["schema_v4"]),
            ]
            for since, script in steps:
                if version <= since:
                    for statement in statements(script):
                        coord.execute(statement)
            coord.execute(f"PRAGMA coord.user_version = {COORD_VERSION:d}")
        check_objects(coord, "coord", self.coord_path, COORD, COORD_VERSION)
        if self.migrated is None:
            self.migrated = (SCHEMA_VERSION, SCHEMA_VERSION)

    def _anchor(self, coord: sqlite3.Connection) -> Any:
        """The store's clock for this boot, anchoring it first if this boot is new."""
        if self._given_clock is not None:
            return self._given_clock
        this_boot = boot_id()
        if this_boot is None or not Uptime.available():
            log.info("no boot-time counter on this platform: the store's clock is the wall clock")
            return WallClock()
        uptime = self._uptime = Uptime()
        row = coord.execute(CQ["clock_get"]).fetchone()
        if row is None or row["boot_id"] != this_boot:
            with immediate(coord):
                row = coord.execute(CQ["clock_get"]).fetchone()
                if row is None or row["boot_id"] != this_boot:
                    # A new boot: the holders of every lease of the last one are gone.
                    for name in ("reboot_job_leases", "reboot_workers", "reboot_resource_leases"):
                        coord.execute(CQ[name])
                    anchor = {"boot_id": this_boot, "wall": time.time(), "uptime": uptime()}
                    coord.execute(CQ["clock_set"], anchor)
                    row = coord.execute(CQ["clock_get"]).fetchone()
        return MachineClock(Anchor(row["boot_id"], row["wall"], row["uptime"]), uptime)

    async def missing(self) -> str | None:
        """What is missing for this store to exist, without creating or changing
        anything: its file, tokenline's tables in it (an empty file, or a database of
        other tables, which opening would write tokenline's schema into), or its
        coordination file; ``None`` when it is a tokenline store, or when the file
        cannot be read (opening says why).

        A file that is there but is no store to create or migrate is refused as opening
        and ``tokenline migrate`` refuse it, with the same error: a directory, another
        application's database, a store whose version was set lower (see
        :func:`check_version`). Told that nothing is there, the operator ran
        ``tokenline migrate``, which then refused the file for what it was."""
        self._refuse_directories()
        if not self.path.is_file():
            return f"no tokenline store at {self.path!s}"
        try:
            conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
            try:
                _, found = check_version(conn, self.path)
            finally:
                conn.close()
        except sqlite3.Error:
            return None
        if not found:
            return f"{str(self.path)!r} holds no tokenline store (no tokenline tables in it)"
        if not self.coord_path.is_file():
            return (
                f"the coordination file {str(self.coord_path)!r} of the store is missing: "
                "a worker, an enqueue or `tokenline migrate` creates it again, and every "
                "lease then expires"
            )
        return None

    async def migrate(self) -> int:
        """Create or upgrade both files' schemas (opening the store does it too) and
        return the schema version."""
        if self._main is None:
            self.migrated = None
            self._migrating = True
            try:
                await self.open()
                await self.close()
            finally:
                self._migrating = self.migrate_on_open
        return SCHEMA_VERSION

    def _peek_now(self) -> float:
        """The store's time as anchored for this boot, read without opening the store
        (the wall clock if this boot has not anchored it yet)."""
        if self._given_clock is not None:
            return float(self._given_clock.now())
        this_boot = boot_id()
        if this_boot is None or not self.coord_path.exists() or not Uptime.available():
            return WallClock().now()
        coord = connect_coord(self.coord_path, busy_timeout=self.timeout)
        try:
            row = coord.execute(CQ["clock_get"]).fetchone()
        except sqlite3.OperationalError:
            row = None
        finally:
            coord.close()
        if row is None or row["boot_id"] != this_boot:
            return WallClock().now()
        uptime = Uptime()
        try:
            return MachineClock(Anchor(row["boot_id"], row["wall"], row["uptime"]), uptime).now()
        finally:
            uptime.close()

    async def close(self) -> None:
        """Close both files and their threads."""
        if self._main is None:
            return
        await self._flush()
        callers, self._callers = self._callers, None
        if callers is not None and not await asyncio.to_thread(callers.close, self._deadline):
            log.warning("closing %s with an enqueue still writing to it", str(self.path))
        lanes = [lane for lane in (self._main, self._coord) if lane is not None]
        here, self._here = self._here, None
        self._main = self._coord = None
        if here is not None:
            here.close()
        for lane in lanes:
            lane.close()
        if self._uptime is not None:
            self._uptime.close()
            self._uptime = None

    # -- broker ---------------------------------------------------------------------------
    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        """Insert all jobs in one transaction and return their ids.

        With ``connection`` (a ``sqlite3.Connection`` to this file inside the caller's
        open transaction) the rows are inserted in that transaction instead.
        """
        if not jobs:
            return []
        if connection is not None:
            _require_transaction(connection)
            self._require_own_file(connection)
            # Inside a ctx.transaction() block, whose guard lets only the store write
            # its job rows (stores/_block.py).
            guard = getattr(connection, "block_guard", None)
            with map_sqlite_errors(self.path), guard.ours() if guard else contextlib.nullcontext():
                # An unopened store (app.enqueue(connection=...)) reads the anchor only.
                now = self.clock.now() if self._main is not None else self._peek_now()
                pairs = zip(self._enqueue_rows(jobs, now), jobs, strict=True)
                try:
                    return [insert_job(connection, Q["enqueue"], *rj) for rj in pairs]
                except sqlite3.OperationalError as exc:
                    if "no such table" not in str(exc):
                        raise
                    raise StoreCorruptError(
                        f"SQLite store {str(self.path)!r} has no tokenline schema ({exc}): "
                        "an enqueue on your own connection never creates it (it runs "
                        "inside your transaction); migrate first, with `tokenline "
                        "migrate`, a worker, or an enqueue without connection="
                    ) from exc
        self._refuse_own_lock()
        try:
            return await self._call(
                lambda conn: self._enqueue_on(conn, jobs), here=len(jobs) <= _HERE_MAX_ROWS
            )
        except Begun as exc:
            raise enqueue_outcome_unknown(exc, len(jobs)) from exc

    def _refuse_own_lock(self) -> None:
        """Raise when the caller (its thread, or its task for an async handler) holds
        this file's write lock in an open fenced transaction: an enqueue on another
        connection would wait for that lock, which its own transaction holds, until the
        store's timeout (a coordination error, retried for ever)."""
        if self._file in held_by_this_thread() or self._file in held_by_this_task():
            raise own_lock_refused(self.path)

    async def broker_write_probe(self, timeout: float) -> None:  # noqa: ASYNC109
        """Take, and give straight back, the file's write lock that every enqueue,
        claim and finish needs, waiting at most ``timeout`` seconds; raise TimeoutError
        when it is not free by then. For ``tokenline status``, whose reads pass while
        every write waits behind another connection's transaction. Writes nothing."""

        def probe() -> None:
            conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise StoreUnavailableError(f"SQLite store {str(self.path)!r}: {exc}") from exc
                raise TimeoutError(
                    f"SQLite store {str(self.path)!r}: its write lock stayed taken for "
                    f"{timeout:g}s: enqueues, claims and finishes wait"
                ) from exc
            finally:
                conn.close()

        await asyncio.to_thread(probe)

    def _require_own_file(self, connection: sqlite3.Connection) -> None:
        """Refuse a caller's connection whose main database is not this store's file:
        the job would be written into whatever store (or database) it has open, where
        no worker of this app looks for it."""
        try:
            rows = connection.execute("PRAGMA database_list").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"connection= cannot be read: {exc}") from exc
        opened = next((str(r[2]) for r in rows if r[1] == "main"), "")
        same = False
        if opened:
            with contextlib.suppress(OSError):
                same = os.path.samefile(opened, self.path)
        if not same:
            raise StoreError(
                f"connection= has {opened or 'an in-memory database'!r} open, not this "
                f"store's file {str(self.path)!r}: enqueue through a connection to the "
                "store's own file"
            )

    @staticmethod
    def _enqueue_rows(jobs: Sequence[NewJob], now: float) -> list[dict[str, Any]]:
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
                    "max_lease_expiries": j.max_lease_expiries,
                    "state": "scheduled" if run_at > now else "queued",
                    "now": now,
                    "timeout": j.timeout,
                }
            )
        return rows

    def _enqueue_on(self, conn: sqlite3.Connection, jobs: Sequence[NewJob]) -> list[int]:
        """Insert ``jobs`` in one write transaction on ``conn`` (the main file's)."""
        if len(jobs) == 1 or any(j.unique is not None for j in jobs):
            # One row at a time, each id its own: a lone job needs nothing more.
            with self._write(conn):
                pairs = zip(self._enqueue_rows(jobs, self.clock.now()), jobs, strict=True)
                return [insert_job(conn, Q["enqueue"], *rj) for rj in pairs]
        with self._write(conn):
            rows = self._enqueue_rows(jobs, self.clock.now())
            first = conn.execute(Q["last_job_id"]).fetchone()
            conn.executemany(Q["enqueue"], rows)
            last = conn.execute(Q["last_job_id"]).fetchone()[0]
        start = (first[0] if first else 0) + 1
        # AUTOINCREMENT under BEGIN IMMEDIATE: ids of this batch are contiguous.
        if last - start + 1 != len(rows):
            raise StoreError("enqueue ids are not contiguous; this is a bug")
        return list(range(start, last + 1))

    def jobs_enqueue_blocking(self, *, jobs: Sequence[NewJob]) -> list[int]:
        """:meth:`jobs_enqueue` on the caller's own thread, with a connection of its own
        (see ``_callers.py``): the same transaction, and the same waits for the write
        lock, as on the store's thread, without the two thread switches."""
        if not jobs:
            return []
        callers = self._callers
        if callers is None:
            raise StoreError("the SQLite store is not open; call open() first")
        self._refuse_own_lock()
        with callers.lend() as conn:
            return self._waiting(lambda: self._enqueue_on(conn, jobs))(lambda: False)

    async def jobs_claim(
        self,
        *,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> list[ClaimedJob]:
        """Lease up to ``limit`` ready jobs to ``owner``: the lease rows first, then the
        claim, both under the main file's write lock."""

        def run(conn: sqlite3.Connection, coord: sqlite3.Connection) -> list[ClaimedJob]:
            with self._write(conn):
                return self._claim_in(conn, coord, owner, queues, limit, ttl, priority_aging)

        return await self._call_both(run, here=limit <= _HERE_MAX_ROWS)

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
        """The fenced finish and the claim in one write transaction, one call."""

        def run(
            conn: sqlite3.Connection, coord: sqlite3.Connection
        ) -> tuple[list[bool], list[ClaimedJob]]:
            with self._write(conn):
                done = self.finish_in(conn, finishes)
                claimed = (
                    self._claim_in(conn, coord, owner, queues, limit, ttl, priority_aging)
                    if limit > 0
                    else []
                )
                return done, claimed

        if not finishes:
            return [], await self.jobs_claim(
                owner=owner, queues=queues, limit=limit, ttl=ttl, priority_aging=priority_aging
            )
        return await self._call_both(run, here=len(finishes) + limit <= _HERE_MAX_ROWS)

    def _claim_in(
        self,
        conn: sqlite3.Connection,
        coord: sqlite3.Connection,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None,
    ) -> list[ClaimedJob]:
        """The claim, inside the caller's write transaction on the main file."""
        if limit <= 0 or not queues:
            return []
        now = self.clock.now()  # after the lock (see the docstring)
        candidates = []
        for queue in dict.fromkeys(queues):
            candidates += claim_candidates(
                conn, queue=queue, now=now, limit=limit, aging=priority_aging
            )
        if not candidates:
            return []
        candidates.sort(key=lambda r: claim_key(r[1], r[2], r[0], now, priority_aging))
        picked = candidates[:limit]
        grants = json.dumps([[r[0], r[3] + 1] for r in picked])
        with immediate(coord):
            coord.execute(
                CQ["job_leases_grant"],
                {"leases": grants, "owner": owner, "ttl": ttl, "now": now},
            )
        ids = json.dumps([r[0] for r in picked])
        params = {"owner": owner, "ids": ids, "ttl": ttl, "now": now}
        rows = conn.execute(Q["claim"], params).fetchall()
        granted = {r[0]: r[3] + 1 for r in picked}
        if any(granted[r["id"]] != r["lease_token"] for r in rows):
            raise StoreError("a claim's token differs from its lease row; this is a bug")
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
            (job_from_row(r) for r in rows),
            key=lambda j: claim_key(j.priority, j.run_at, j.id, now, priority_aging),
        )
        return [
            ClaimedJob(j, Lease(j.id, owner, j.lease_token, j.lease_expires_at or now + ttl))
            for j in jobs
        ]

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

    def _record_stale_tx(
        self, conn: sqlite3.Connection, leases: Sequence[Lease], operation: str, now: float
    ) -> None:
        with self._write(conn):
            self._record_stale(conn, leases, operation, now)

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
        return await self._call(run, here=len(finishes) <= _HERE_MAX_ROWS)

    async def jobs_rescue(
        self, *, limit: int = 1000, leader: ResourceLease | None = None
    ) -> RescueReport:
        """Requeue or dead-letter running jobs without a live lease, by the store's clock,
        if ``leader`` (when given) still holds the maintenance lease."""

        def run(conn: sqlite3.Connection, coord: sqlite3.Connection) -> RescueReport:
            requeued: list[int] = []
            dead: list[int] = []
            with self._write(conn):
                now = self.clock.now()
                check_leader(conn, self._q("leader_holds"), leader, "rescue", now)
                rows = conn.execute(Q["rescue_candidates"], {"now": now, "limit": limit})
                for row in rows.fetchall():
                    cand = RescueCandidate(*tuple(row))
                    rescue = rescue_transition(cand)
                    move = rescue.transition
                    params = {
                        "job_id": cand.job_id,
                        "token": cand.token,
                        "now": now,
                        "state": move.state.value,
                        "final": move.finished,
                        "refund": move.refund,
                        "run_at": None if move.delay is None else now + move.delay,
                        "error": rescue.reason,
                    }
                    conn.execute(Q["rescue_attempt"], params)
                    if conn.execute(Q["rescue"], params).rowcount == 1:
                        (dead if move.state is JobState.DEAD else requeued).append(cand.job_id)
            with immediate(coord):
                coord.execute(CQ["job_leases_prune"], {"before": now - _PRUNE_AFTER})
            return RescueReport(requeued=sorted(requeued), dead=sorted(dead))

        return await self._call_both(run)

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

    async def jobs_depth(self) -> list[Depth]:
        """Unfinished jobs per queue, task and state: one grouped read."""
        params = {"now": self.clock.now()}
        rows = await self._call(lambda c: c.execute(Q["jobs_depth"], params).fetchall())
        return [Depth(*tuple(r)) for r in rows]

    # -- inspection -----------------------------------------------------------------------
    async def job_get(self, *, job_id: int) -> Job:
        """The job, or :class:`JobNotFoundError`."""
        if not possible_job_id(job_id):
            raise JobNotFoundError(f"no job with id {job_id}")
        row = await self._call(lambda c: c.execute(Q["job_get"], {"job_id": job_id}).fetchone())
        if row is None:
            raise JobNotFoundError(f"no job with id {job_id}")
        return _job(row)

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
        rows = await self._call(lambda c: c.execute(Q["jobs_list"], params).fetchall())
        return [_job(r) for r in rows]

    async def job_attempts(self, *, job_id: int) -> list[Attempt]:
        """Attempts of the job, oldest first."""
        await self.job_get(job_id=job_id)
        rows = await self._call(
            lambda c: c.execute(Q["attempts_list"], {"job_id": job_id}).fetchall()
        )
        return [attempt_from_row(r) for r in rows]

    async def jobs_retry_dead(self, *, job_ids: Sequence[int]) -> int:
        """Requeue dead jobs with a fresh budget of their own ``max_attempts``."""
        params = {"ids": json.dumps(possible_job_ids(job_ids)), "now": self.clock.now()}
        return await self._call(lambda c: c.execute(Q["retry_dead"], params).rowcount)

    async def jobs_cancel(self, *, job_ids: Sequence[int], reason: str) -> int:
        """Cancel queued, scheduled or dead jobs."""
        ids = json.dumps(possible_job_ids(job_ids))
        params = {"ids": ids, "now": self.clock.now(), "reason": reason}
        return await self._call(lambda c: c.execute(Q["cancel"], params).rowcount)

    async def stale_commits(self, *, limit: int = 100) -> tuple[int, list[StaleCommit]]:
        """Total refused writes and the most recent ``limit``."""

        def run(conn: sqlite3.Connection) -> tuple[int, list[StaleCommit]]:
            total = conn.execute(Q["stale_count"]).fetchone()[0]
            rows = conn.execute(Q["stale_list"], {"limit": limit}).fetchall()
            return total, [StaleCommit(*tuple(r)) for r in rows]

        await self._flush()
        return await self._call(run)

    # -- transactions ---------------------------------------------------------------------
    def fenced_transaction(
        self, *, lease: Lease, fences: Sequence[Fence] = (), timeout: float | None = None
    ) -> FencedTransaction:
        """A transaction on this file that checks ``lease`` first, then advances
        ``fences``, and completes the job on commit. ``timeout`` (the attempt's
        remaining time) is how long it may wait for another writer's lock to begin."""
        from ._transaction import SQLiteFencedTransaction  # it builds on this module

        return SQLiteFencedTransaction(self, lease, fences, timeout)

    def async_transaction_gate(self) -> asyncio.Lock:
        """The lock an ``async with`` fenced transaction of this store holds from before
        its begin to after its end (see ``_transaction.py``), one per event loop."""
        loop = asyncio.get_running_loop()
        gate = self._async_gates.get(loop)
        if gate is None:
            gate = self._async_gates[loop] = asyncio.Lock()
        return gate

    def transaction_connection(self, wait: float | None = None) -> sqlite3.Connection:
        """A new connection for a fenced transaction (main file, leases read-only),
        usable from any thread; it waits up to ``wait`` seconds for the write lock."""
        return connect_main(
            self.path,
            busy_timeout=self.timeout if wait is None else max(wait, self.timeout),
            same_thread=False,
            coord=self.coord_path,
        )

    @contextlib.contextmanager
    def holding_write_lock(self) -> Any:
        """Marks a fenced transaction of this process holding the main file's lock."""
        self._writers.opened()
        try:
            yield
        finally:
            self._writers.closed()


def _require_transaction(connection: object) -> None:
    """Refuse a caller's ``connection=`` that is no open ``sqlite3.Connection`` inside a
    transaction: its inserts would commit on their own, or fail with the driver's words."""
    if not isinstance(connection, sqlite3.Connection):
        raise StoreError(
            "connection= must be a sqlite3.Connection inside an open transaction, not "
            f"{type(connection).__name__}"
        )
    try:
        in_transaction = connection.in_transaction
    except sqlite3.ProgrammingError:  # "Cannot operate on a closed database."
        raise StoreError(
            "connection= is closed: enqueue on an open connection, inside its transaction"
        ) from None
    if not in_transaction:
        raise StoreError("connection= must be a sqlite3.Connection inside an open transaction")
