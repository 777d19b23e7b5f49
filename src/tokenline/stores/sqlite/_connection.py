"""Connections to the SQLite store's two files, and the write transaction they share.

Every connection sees the coordination file as the schema ``coord`` (see ``coord.sql``),
so one set of queries serves them all:

* the **main** connection (jobs, attempts, ledger) attaches it read-only: its write
  transactions take only the main file's write lock, and read a snapshot of the leases;
* a **coordination** connection (renewals, membership, resource leases, the clock
  anchor) opens an in-memory main database and attaches the file read-write, so its
  write transactions lock only the coordination file.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "Connection",
    "attach_coord",
    "begin_immediate",
    "busy_timeout",
    "connect_coord",
    "connect_main",
    "coord_path",
    "immediate",
    "rollback",
    "set_busy_timeout",
    "statements",
]


class Connection(sqlite3.Connection):
    """A ``sqlite3`` connection that remembers its busy timeout.

    Every write transaction needs it (see :func:`begin_immediate`); asking SQLite with a
    ``PRAGMA`` each time cost a statement per transaction, a tenth of a claim's time.
    Set it with :func:`set_busy_timeout` only, so that the record stays true.
    """

    #: SQLite's busy timeout on this connection, in milliseconds.
    busy_ms: int = 0
    #: For a connection that only ever runs write transactions (see ``connect_main``):
    #: how long :func:`begin_immediate` waits for another connection's write lock, in
    #: milliseconds, while SQLite's own busy timeout stays 0. ``None``: the busy timeout
    #: is the wait.
    lock_wait_ms: int | None = None
    #: The guard of the ``ctx.transaction()`` block this connection is lent to, if any
    #: (see ``stores/_block.py``): the store's own writes in the block go through it.
    block_guard: Any = None

    def close(self) -> None:
        """Close the connection; refused while it is lent to a ``ctx.transaction()``
        block, which would lose the block's transaction, and the job's completion with
        it (the block then ends in the permanent error that says so)."""
        guard = self.block_guard
        if guard is not None:
            guard.ended, guard.transaction = "conn.close()", True
            raise guard.refusal()
        super().close()


def busy_timeout(conn: sqlite3.Connection) -> int:
    """``conn``'s busy timeout in milliseconds (asked of SQLite for a foreign connection)."""
    if isinstance(conn, Connection):
        return conn.busy_ms
    return int(conn.execute("PRAGMA busy_timeout").fetchone()[0])


def set_busy_timeout(conn: sqlite3.Connection, ms: int) -> None:
    """Set ``conn``'s busy timeout to ``ms`` milliseconds (nothing to do if it is already)."""
    if isinstance(conn, Connection):
        if conn.busy_ms == ms:
            return
        conn.execute(f"PRAGMA busy_timeout = {int(ms):d}")
        conn.busy_ms = ms
        return
    conn.execute(f"PRAGMA busy_timeout = {int(ms):d}")


def coord_path(main: Path) -> Path:
    """The coordination file beside the store file ``main`` (``<name>-coord``)."""
    return main.with_name(main.name + "-coord")


def _uri(path: Path, *, readonly: bool = False) -> str:
    uri = path.resolve().as_uri()
    return f"{uri}?mode=ro" if readonly else uri


#: Pages of write-ahead log (4 KiB each) after which a commit checkpoints it into the file.
#: SQLite's default, 1,000, had a job queue checkpoint every few dozen jobs, copying the
#: same hot index pages back again and again inside the committing call: half of a
#: claim's cost. Ten times that coalesces them (about 40 MB of log on disk).
WAL_AUTOCHECKPOINT = 10_000
#: Bytes a write-ahead log is cut back to when it starts again from its beginning: it
#: otherwise keeps the size it once reached, for as long as the file is in use.
WAL_SIZE_LIMIT = 32 * 1024 * 1024


def _tune(conn: sqlite3.Connection) -> sqlite3.Connection:
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT:d}")
    conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT:d}")
    return conn


def _connect(target: str, wait: float, same_thread: bool) -> Connection:
    conn = sqlite3.connect(
        target,
        uri=True,
        isolation_level=None,
        timeout=wait,
        check_same_thread=same_thread,
        factory=Connection,
    )
    conn.busy_ms = round(wait * 1000)
    return conn


def connect_main(
    path: Path,
    *,
    busy_timeout: float,
    same_thread: bool = True,
    coord: Path | None = None,
    writes_only: bool = False,
) -> Connection:
    """A connection to the store file; with ``coord``, that file attached read-only.

    ``writes_only``: every statement the connection will run is inside
    :func:`immediate`, whose ``BEGIN IMMEDIATE`` is the one statement that can meet
    another connection's lock (in WAL mode the transaction holds its snapshot and the
    write lock from there on). SQLite's own busy wait is then switched off for good, and
    :func:`begin_immediate` waits ``busy_timeout`` in its short pauses without switching
    it off and on again around each transaction: two statements, a tenth of a single
    enqueue's time.
    """
    conn = _connect(_uri(path), busy_timeout, same_thread)
    try:
        _tune(conn)
        if writes_only:
            conn.lock_wait_ms = conn.busy_ms
            set_busy_timeout(conn, 0)
        if coord is not None:
            attach_coord(conn, coord, readonly=True)
    except BaseException:
        conn.close()
        raise
    return conn


def attach_coord(conn: sqlite3.Connection, path: Path, *, readonly: bool) -> None:
    """Attach the coordination file ``path`` to ``conn`` as the schema ``coord``."""
    conn.execute("ATTACH DATABASE ? AS coord", (_uri(path, readonly=readonly),))


def connect_coord(path: Path, *, busy_timeout: float, same_thread: bool = True) -> Connection:
    """A connection whose writes lock only the coordination file ``path``."""
    conn = _connect(":memory:", busy_timeout, same_thread)
    try:
        _tune(conn)
        attach_coord(conn, path, readonly=False)
        conn.execute("PRAGMA coord.synchronous = NORMAL")
        conn.execute(f"PRAGMA coord.journal_size_limit = {WAL_SIZE_LIMIT:d}")
    except BaseException:
        conn.close()
        raise
    return conn


#: Pauses between tries for another connection's write lock, in seconds; the last one
#: repeats. SQLite's own busy handler sleeps 1, 2, 5, 10 ms…, while the write
#: transactions here hold the lock for a fraction of a millisecond: with two busy
#: processes on one file, most of their time went to those sleeps.
_LOCK_PAUSES = (0.0001, 0.0002, 0.0005, 0.001)


def begin_immediate(conn: sqlite3.Connection) -> None:
    """``BEGIN IMMEDIATE``, waiting for a write lock another connection holds for up to
    ``conn``'s busy timeout (its ``lock_wait_ms``, for a connection opened
    ``writes_only``), in short pauses; then SQLite's busy error, as before."""
    if isinstance(conn, Connection) and conn.lock_wait_ms is not None:
        _begin_in_pauses(conn, conn.lock_wait_ms)
        return
    waited = busy_timeout(conn)
    if not waited:
        conn.execute("BEGIN IMMEDIATE")
        return
    set_busy_timeout(conn, 0)
    try:
        _begin_in_pauses(conn, waited)
    finally:
        set_busy_timeout(conn, waited)


def _begin_in_pauses(conn: sqlite3.Connection, waited: int) -> None:
    """``BEGIN IMMEDIATE`` on ``conn``, whose busy timeout is 0, tried again after short
    pauses for up to ``waited`` milliseconds while another connection holds the lock."""
    deadline = time.monotonic() + waited / 1000
    tries = 0
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            code = getattr(exc, "sqlite_errorcode", None)
            if code is None or code & 0xFF != sqlite3.SQLITE_BUSY:
                raise
            if time.monotonic() >= deadline:
                raise
        time.sleep(_LOCK_PAUSES[min(tries, len(_LOCK_PAUSES) - 1)])
        tries += 1


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back ``conn``'s transaction while an error is on its way out, if SQLite has
    not already done so.

    After a full disk or an I/O error SQLite may have rolled the transaction back
    itself; a ``ROLLBACK`` then fails with "no transaction is active", which would hide
    the error that matters. A ``ROLLBACK`` that fails for another reason is dropped for
    the same reason: the error on its way out is the one to report.
    """
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


@contextlib.contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction that takes the write lock up front (of every file the
    connection may write; a read-only attachment only gets a read snapshot)."""
    begin_immediate(conn)
    try:
        yield conn
    except BaseException:
        rollback(conn)
        raise
    try:
        conn.execute("COMMIT")
    except BaseException:
        # A COMMIT that failed may leave the transaction open (busy, or interrupted):
        # on a connection the store keeps, it would hold the write lock for good.
        rollback(conn)
        raise


def statements(script: str) -> Iterator[str]:
    """Split a script into complete statements (a trigger body holds semicolons)."""
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            yield buf.strip()
            buf = ""
    if buf.strip() and not buf.strip().startswith("--"):
        yield buf.strip()
