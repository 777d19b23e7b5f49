"""Connections to the store file lent to synchronous callers, used on their own threads.

A single ``app.enqueue`` from ordinary code is one short write transaction. Handed to
the store's thread and waited for, the two thread switches cost more than the insert
itself (on 2 cores: about 4,000 enqueues/s through the thread, 10,000 on the caller's
own). So a blocking enqueue borrows a connection of its own from here and writes on
the caller's thread; the file's write lock orders it with every other writer, in this
process or another, exactly as it orders two processes.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator

from ..._errors import StoreError

__all__ = ["CallerConnections", "held_by_this_thread"]

_local = threading.local()


def held_by_this_thread() -> set[str]:
    """Store files (resolved paths) whose write lock a fenced transaction of the current
    thread holds: a blocking write there from this thread would wait for itself."""
    held: set[str] | None = getattr(_local, "files", None)
    if held is None:
        held = _local.files = set()
    return held


class CallerConnections:
    """Main-file connections lent to synchronous callers, one call at a time each.

    Up to ``keep`` idle connections are kept for the next callers; more are opened
    while more callers write at once (SQLite lets one of them write at a time anyway),
    and closed when they come back. A connection whose call raised is closed rather
    than lent again: whatever state the error left it in goes with it.
    """

    def __init__(self, connect: Callable[[], sqlite3.Connection], *, keep: int = 4) -> None:
        self._connect = connect
        self._keep = keep
        self._cond = threading.Condition()
        self._idle: list[sqlite3.Connection] = []
        self._lent = 0
        self._closed = False

    @contextlib.contextmanager
    def lend(self) -> Iterator[sqlite3.Connection]:
        """A connection for the caller's thread until the block ends."""
        with self._cond:
            if self._closed:
                raise StoreError("the SQLite store is closed")
            conn = self._idle.pop() if self._idle else None
            self._lent += 1
        try:
            if conn is None:
                conn = self._connect()
            yield conn
        except BaseException:
            if conn is not None:
                conn.close()
            conn = None
            raise
        finally:
            with self._cond:
                self._lent -= 1
                if conn is not None and not self._closed and len(self._idle) < self._keep:
                    self._idle.append(conn)
                    conn = None
                self._cond.notify_all()
            if conn is not None:
                conn.close()

    @property
    def idle(self) -> int:
        """Connections waiting for a caller."""
        with self._cond:
            return len(self._idle)

    def close(self, timeout: float) -> bool:
        """Lend no more, close the idle connections and wait up to ``timeout`` seconds
        for the lent ones to come back (each is closed then). Whether they all did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        with self._cond:
            return self._cond.wait_for(
                lambda: self._lent == 0, max(0.0, deadline - time.monotonic())
            )
