"""Connections to the store file lent to synchronous callers, used on their own threads.

A single ``app.enqueue`` from ordinary code is one short write transaction. Handed to
the store's thread and waited for, the two thread switches cost more than the insert
itself (on 2 cores: about 4,000 enqueues/s through the thread, 10,000 on the caller's
own). So a blocking enqueue borrows a connection of its own from here and writes on
the caller's thread; the file's write lock orders it with every other writer, in this
process or another, exactly as it orders two processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator

from ..._errors import NotSupportedError, StoreError

__all__ = [
    "CallerConnections",
    "held_by_this_task",
    "held_by_this_thread",
    "holding_in_task",
    "own_lock_refused",
]

_local = threading.local()
#: (store file, task id) of each ``async with`` fenced transaction open in this context:
#: the context is copied into the threads and loops that a task's calls hop to, so a
#: write asked for on the task's behalf can tell that the task holds the lock. Tasks the
#: holder starts inherit the context, not the mark: they are other tasks.
_held_in_task: contextvars.ContextVar[frozenset[tuple[str, int]]] = contextvars.ContextVar(
    "tokenline_sqlite_held_in_task", default=frozenset()
)


def held_by_this_thread() -> set[str]:
    """Store files (resolved paths) whose write lock a fenced transaction of the current
    thread holds: a blocking write there from this thread would wait for itself."""
    held: set[str] | None = getattr(_local, "files", None)
    if held is None:
        held = _local.files = set()
    return held


def held_by_this_task() -> frozenset[str]:
    """Store files whose write lock an ``async with`` fenced transaction of the current
    task holds (an async handler): a write there without the transaction's connection,
    awaited by the task, would wait for the transaction it waits in. Empty off a loop:
    a thread cannot tell which task it works for."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return frozenset()
    if task is None:
        return frozenset()
    return frozenset(file for file, holder in _held_in_task.get() if holder == id(task))


@contextlib.contextmanager
def holding_in_task(file: str) -> Iterator[None]:
    """Mark ``file`` held by the current task within the block."""
    task = asyncio.current_task()
    if task is None:
        yield
        return
    token = _held_in_task.set(_held_in_task.get() | {(file, id(task))})
    try:
        yield
    finally:
        try:
            _held_in_task.reset(token)
        except ValueError:  # left in another context: take the mark off there
            _held_in_task.set(_held_in_task.get() - {(file, id(task))})


def own_lock_refused(path: object, what: str = "enqueue") -> NotSupportedError:
    """The refusal of a write (``what``: an enqueue, a cancel) that would wait for its
    caller's own transaction on the SQLite store at ``path``."""
    if what == "enqueue":
        instead = (
            "pass connection=conn to enqueue in that transaction (the job then exists if "
            "and only if it commits), or enqueue after it"
        )
    else:
        instead = f"{what} before or after it"
    return NotSupportedError(
        f"{what} inside an open ctx.transaction() on SQLite ({str(path)!r}) would wait "
        f"for the transaction's own write lock: {instead}"
    )


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
