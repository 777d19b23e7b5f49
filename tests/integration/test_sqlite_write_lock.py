"""Waiting for another connection's write lock on a SQLite file: in short pauses, for
as long as the connection's busy timeout, and no longer (see begin_immediate)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from tokenline.stores.sqlite import _connection
from tokenline.stores.sqlite._connection import begin_immediate


def _connect(path: Path, timeout: float) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=timeout, check_same_thread=False)
    conn.execute("PRAGMA journal_mode = WAL")
    return conn


def _letting_go_after_five_pauses(
    holder: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch
) -> list[float]:
    """Record the waiter's pauses (the list returned); the holder commits at the fifth,
    while the waiter waits."""
    pauses: list[float] = []
    real_sleep = _connection.time.sleep

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 5:
            holder.execute("COMMIT")
        real_sleep(seconds)

    monkeypatch.setattr(_connection.time, "sleep", pause)
    return pauses


def test_a_held_lock_is_waited_for_in_short_pauses_then_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another connection holds the lock, the waiter pauses a tenth of a
    millisecond, then a little longer, never SQLite's own first millisecond; once the
    holder commits, it has the lock, and its busy timeout is as it was."""
    holder = _connect(tmp_path / "f.db", 5.0)
    waiter = _connect(tmp_path / "f.db", 5.0)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    pauses = _letting_go_after_five_pauses(holder, monkeypatch)
    begin_immediate(waiter)
    waiter.execute("INSERT INTO t VALUES (1)")
    waiter.execute("COMMIT")
    assert len(pauses) >= 5
    assert pauses[0] < 0.001, pauses
    assert max(pauses) <= 0.001, pauses
    assert waiter.execute("PRAGMA busy_timeout").fetchone()[0] == 5000


def test_the_wait_ends_with_sqlites_busy_error_after_the_busy_timeout(tmp_path: Path) -> None:
    """A lock held past the waiter's busy timeout: SQLite's busy error, as without the
    short pauses, and the timeout is restored."""
    holder = _connect(tmp_path / "f.db", 5.0)
    waiter = _connect(tmp_path / "f.db", 0.05)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as caught:
        begin_immediate(waiter)
    code: Any = getattr(caught.value, "sqlite_errorcode", None)
    assert code is not None
    assert code & 0xFF == sqlite3.SQLITE_BUSY
    assert waiter.execute("PRAGMA busy_timeout").fetchone()[0] == 50
    assert not waiter.in_transaction
    holder.execute("ROLLBACK")


def test_no_busy_timeout_means_no_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection with no busy timeout gets the busy error at once, unpaused."""
    holder = _connect(tmp_path / "f.db", 5.0)
    waiter = _connect(tmp_path / "f.db", 0.0)
    holder.execute("BEGIN IMMEDIATE")
    monkeypatch.setattr(_connection.time, "sleep", lambda s: pytest.fail("paused"))
    with pytest.raises(sqlite3.OperationalError):
        begin_immediate(waiter)
    holder.execute("ROLLBACK")


def test_concurrent_writers_all_get_through(tmp_path: Path) -> None:
    """Four threads, each with its own connection, 200 short write transactions each:
    every one commits, none sees a busy error."""
    _connect(tmp_path / "f.db", 5.0).execute("CREATE TABLE t (x)")
    errors: list[BaseException] = []

    def write(n: int) -> None:
        conn = _connect(tmp_path / "f.db", 5.0)
        try:
            for i in range(200):
                with _connection.immediate(conn):
                    conn.execute("INSERT INTO t VALUES (?)", (n * 1000 + i,))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _connect(tmp_path / "f.db", 5.0).execute("SELECT count(*) FROM t").fetchone()[0] == 800


def test_a_store_connection_takes_the_lock_without_asking_sqlite_its_timeout(
    tmp_path: Path,
) -> None:
    """The store's connections remember their busy timeout: a write transaction sends
    BEGIN IMMEDIATE and its statements, not a PRAGMA to read the timeout first, and the
    timeout SQLite has stays the one remembered."""
    conn = _connection.connect_main(tmp_path / "f.db", busy_timeout=2.0)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (x)")
    sent: list[str] = []
    conn.set_trace_callback(sent.append)
    with _connection.immediate(conn):
        conn.execute("INSERT INTO t VALUES (1)")
    conn.set_trace_callback(None)
    assert not [s for s in sent if s.strip().upper() == "PRAGMA BUSY_TIMEOUT"], sent
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 2000
    _connection.set_busy_timeout(conn, 0)
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 0
    assert _connection.busy_timeout(conn) == 0
    sent.clear()
    conn.set_trace_callback(sent.append)
    _connection.set_busy_timeout(conn, 0)  # already so: nothing sent
    conn.set_trace_callback(None)
    assert sent == []


def test_a_writes_only_connection_waits_in_pauses_with_sqlites_own_wait_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection opened ``writes_only`` (a synchronous caller's, for enqueue) keeps
    SQLite's busy timeout at 0 for good: its write transaction sends no PRAGMA at all,
    yet waits in short pauses for a lock another connection holds, and then has it;
    past its wait, SQLite's busy error, with no transaction left open."""
    conn = _connection.connect_main(tmp_path / "f.db", busy_timeout=2.0, writes_only=True)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (x)")
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 0
    sent: list[str] = []
    conn.set_trace_callback(sent.append)
    with _connection.immediate(conn):
        conn.execute("INSERT INTO t VALUES (1)")
    conn.set_trace_callback(None)
    assert not [s for s in sent if "PRAGMA" in s.upper()], sent

    holder = _connect(tmp_path / "f.db", 5.0)
    holder.execute("BEGIN IMMEDIATE")
    pauses = _letting_go_after_five_pauses(holder, monkeypatch)
    with _connection.immediate(conn):
        conn.execute("INSERT INTO t VALUES (2)")
    assert len(pauses) >= 5
    assert max(pauses) <= 0.001, pauses
    monkeypatch.undo()

    short = _connection.connect_main(tmp_path / "f.db", busy_timeout=0.05, writes_only=True)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as caught:
        begin_immediate(short)
    code: Any = getattr(caught.value, "sqlite_errorcode", None)
    assert code is not None
    assert code & 0xFF == sqlite3.SQLITE_BUSY
    assert not short.in_transaction
    assert short.execute("PRAGMA busy_timeout").fetchone()[0] == 0
    holder.execute("ROLLBACK")
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 2
