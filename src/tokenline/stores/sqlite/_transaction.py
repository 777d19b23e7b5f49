"""``ctx.transaction()`` on SQLite: the user's writes, fences and the completion, atomically.

Why a stale worker cannot commit through it: the transaction opens with ``BEGIN
IMMEDIATE`` (the main file's write lock, across processes) and its first statement proves
the job's token (``fence_check``); each requested fence is then advanced, refusing a lower
token. Until ``COMMIT`` nobody else can write to the main file, so neither a rescue nor a
newer attempt can come between those checks and the user's writes; the job is finished
with the same fenced statement as ``jobs_finish``, and one ``COMMIT`` makes everything
durable together. A refusal rolls back before the user wrote anything and is recorded on
its own.

Why it may stay open for longer than the lease TTL: the leases live in the coordination
file, which this connection reads but never locks, so the worker's control plane keeps
renewing this job's lease and every other (``store.py``). Other writers of the main file
— this worker's other completions and claims included — wait for the ``COMMIT``: SQLite
has one writer at a time. While the transaction holds the lock, this process's own calls
wait for it rather than report the store unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._errors import StaleTokenError
from ..._jobs import Finish, Lease, Outcome
from ..._records import DuplicateKind, Fence, by_attempt
from .._block import BlockGuard
from ..base import FencedTransaction
from ._callers import held_by_this_thread, holding_in_task
from ._connection import Connection, begin_immediate, rollback
from ._errors import map_sqlite_errors

if TYPE_CHECKING:
    from .store import SQLiteStore

__all__ = ["SQLiteFencedTransaction"]


class SQLiteFencedTransaction(FencedTransaction):
    """See :class:`FencedTransaction`. Opens its own connection to the same file."""

    def __init__(
        self,
        store: SQLiteStore,
        lease: Lease,
        fences: Sequence[Fence] = (),
        wait: float | None = None,
    ) -> None:
        self._store = store
        self._lease = lease
        self._fences = tuple(fences)
        # Another process's transaction may hold the lock for a while: waiting for it
        # (as long as the attempt may run) beats giving the job back and starting over.
        self._wait = wait
        self._conn: sqlite3.Connection | None = None
        self._holding: contextlib.AbstractContextManager[Any] | None = None
        # A sync `with` holds the lock on the caller's thread until it exits there: a
        # blocking enqueue from that thread meanwhile would wait for itself (see
        # jobs_enqueue_blocking). An `async with` enters and exits on pool threads.
        self._async = False
        self._marked: str | None = None
        self._guard = BlockGuard()
        self._gate: asyncio.Lock | None = None
        # An `async with` marks its task instead (see jobs_enqueue).
        self._task_mark: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> sqlite3.Connection:
        store, lease = self._store, self._lease
        with map_sqlite_errors(store.path):
            conn = store.transaction_connection(self._wait)
            try:
                begin_immediate(conn)
                self._holding = store.holding_write_lock()
                self._holding.__enter__()
                held = held_by_this_thread()
                if not self._async and store._file not in held:
                    held.add(store._file)
                    self._marked = store._file
                now = store.clock.now()
                params = {
                    "job_id": lease.job_id,
                    "token": lease.token,
                    "owner": lease.owner,
                    "now": now,
                }
                if conn.execute(store._q("fence_check"), params).rowcount != 1:
                    conn.execute("ROLLBACK")
                    with store._write(conn):
                        store._record_stale(conn, [lease], "transaction", store.clock.now())
                    self._close(conn)
                    raise StaleTokenError(
                        resource=f"job {lease.job_id}", token=lease.token, operation="transaction"
                    )
                refused = store.fences_in(conn, lease, self._fences, now)
                if refused is not None:
                    conn.execute("ROLLBACK")
                    with store._write(conn):
                        stale = by_attempt(
                            refused.key, DuplicateKind.STALE, "fence", lease, store.clock.now()
                        )
                        store.record_duplicate(conn, stale)
                    self._close(conn)
                    raise StaleTokenError(
                        resource=f"fence {refused.key!r}",
                        token=refused.token,
                        operation="transaction",
                    )
            except BaseException:
                self._close(conn)  # again after a refusal above: closing twice is harmless
                raise
        self._guard.install(conn)  # from here the block may not end it (_block.py)
        if isinstance(conn, Connection):
            conn.block_guard = self._guard
        self._conn = conn
        return conn

    def _close(self, conn: sqlite3.Connection) -> None:
        try:
            conn.close()
        finally:
            holding, self._holding = self._holding, None
            if holding is not None:
                holding.__exit__(None, None, None)
            marked, self._marked = self._marked, None
            if marked is not None:
                held_by_this_thread().discard(marked)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        store = self._store
        try:
            self._guard.remove(conn)
            if isinstance(conn, Connection):
                conn.block_guard = None
            with map_sqlite_errors(store.path):
                if self._guard.ended is not None:
                    rollback(conn)
                    raise self._guard.refusal() from exc
                if exc_type is not None:
                    # The caller's error is the one to see, even where SQLite has
                    # already rolled back (a full disk).
                    rollback(conn)
                    return
                completed = self._complete(conn)
                conn.execute("COMMIT")
                self.wrote = True
                self.committed = completed
        finally:
            self._close(conn)

    def _complete(self, conn: sqlite3.Connection) -> bool:
        """Finish the job as succeeded inside the transaction (so that the one COMMIT
        makes it durable with the user's writes); whether it was."""
        (ok,) = self._store.finish_in(conn, [Finish(self._lease, Outcome.SUCCEEDED)])
        if not ok:  # impossible under the write lock, unless the file was edited
            conn.execute("ROLLBACK")
            raise StaleTokenError(
                resource=f"job {self._lease.job_id}",
                token=self._lease.token,
                operation="transaction",
            )
        return True

    async def __aenter__(self) -> sqlite3.Connection:
        self._async = True
        # One async block of this store at a time waits for the write lock, on the event
        # loop: each waiting begin holds a thread of the loop's default pool, and the
        # block holding the lock needs one of those threads to commit. With more async
        # blocks than threads, all waited for a commit that could not run (until their
        # lock waits ran out). SQLite lets one of them write at a time anyway.
        gate = self._store.async_transaction_gate()
        await gate.acquire()
        try:
            conn: sqlite3.Connection = await self._enter_on_a_thread()
        except BaseException:
            gate.release()
            raise
        self._gate = gate
        self._task_mark = holding_in_task(self._store._file)
        self._task_mark.__enter__()
        return conn

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        gate, self._gate = self._gate, None
        mark, self._task_mark = self._task_mark, None
        try:
            await asyncio.to_thread(self.__exit__, exc_type, exc, tb)
        finally:
            if mark is not None:
                mark.__exit__(None, None, None)
            if gate is not None:
                gate.release()
