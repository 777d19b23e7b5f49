"""``ctx.transaction()`` on the in-memory store: the same contract, in one process.

``memory://`` has no database of its own, so the store keeps one for its users: a
private in-memory SQLite database (``MemoryStore.database``), shared by every job of the
process, with the SQLite parameter style (``?``). A transaction takes it for itself
(one at a time), begins, and hands the ``sqlite3`` connection to the handler.

Why a stale attempt cannot commit through it: the token is checked when the
transaction begins (refused: rolled back, recorded, :class:`StaleTokenError`), and again
at the end under the store's lock, which every claim, rescue and finish takes: there the
fences are advanced, the job is marked succeeded and the database commits, all before
the lock is let go. A job rescued meanwhile fails that second check, and the user's
writes roll back.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._errors import StaleTokenError
from ..._jobs import Finish, Lease, Outcome
from ..._records import Fence
from .._block import BlockGuard
from ..base import FencedTransaction

if TYPE_CHECKING:
    from .store import MemoryStore

__all__ = ["MemoryDatabase", "MemoryFencedTransaction", "refusal"]


class MemoryDatabase:
    """The in-memory store's business database: one SQLite connection, one user at a
    time (a transaction holds it from its start to its end)."""

    def __init__(self) -> None:
        self.connection = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.lock = threading.Lock()


class MemoryFencedTransaction(FencedTransaction):
    """See the module docstring; ``with`` or ``async with``."""

    def __init__(self, store: MemoryStore, lease: Lease, fences: Sequence[Fence]) -> None:
        self._store = store
        self._lease = lease
        self._fences = tuple(fences)
        self._held = False
        self._guard = BlockGuard()

    def __enter__(self) -> sqlite3.Connection:
        store, db = self._store, self._store.database
        refused = store.check_transaction(self._lease, self._fences)
        if refused is not None:
            raise refused
        db.lock.acquire()
        self._held = True
        try:
            db.connection.execute("BEGIN")
        except BaseException:
            self._release()
            raise
        self._guard.install(db.connection)  # from here the block may not end it
        return db.connection

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._store.database.lock.release()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._held:
            return
        conn = self._store.database.connection
        try:
            self._guard.remove(conn)
            if self._guard.ended is not None:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise self._guard.refusal() from exc
            if exc_type is not None:
                # The caller's error is the one to see: a ROLLBACK with no transaction
                # left (SQLite ended it after an error) would fail and hide it.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                return
            refused = self._store.commit_transaction(
                Finish(self._lease, Outcome.SUCCEEDED), self._fences, conn.commit
            )
            if refused is not None:
                conn.execute("ROLLBACK")
                raise refused
            self.wrote = self.committed = True
        finally:
            self._release()

    async def __aenter__(self) -> sqlite3.Connection:
        # The database's lock may be held by another job's transaction: wait for it off
        # the event loop.
        conn: sqlite3.Connection = await self._enter_on_a_thread()
        return conn

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)


def refusal(lease: Lease, fence: Fence | None) -> StaleTokenError:
    """The error for a transaction refused at its end (``fence``: the fence refused)."""
    if fence is not None:
        return StaleTokenError(
            resource=f"fence {fence.key!r}", token=fence.token, operation="transaction"
        )
    return StaleTokenError(
        resource=f"job {lease.job_id}", token=lease.token, operation="transaction"
    )
