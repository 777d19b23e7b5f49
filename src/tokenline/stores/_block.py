"""The block of a fenced transaction on a ``sqlite3`` connection may not end it.

``with ctx.transaction() as conn:`` hands the handler the connection inside the open
transaction. A commit inside the block would make the handler's writes durable
without the job's completion, and a failure after it would run them again; a rollback
would let the block's later statements commit one by one. So while the block runs,
every statement that would end the transaction (``COMMIT``, ``END``, ``ROLLBACK``,
``conn.commit()``, ``conn.rollback()``, the commit that ``executescript`` begins with)
is refused by SQLite itself: it asks the connection's authorizer before compiling any
statement. Savepoints stay allowed: they never end the transaction. Nor may the block
insert, change or delete tokenline's own job rows (SQLite's store keeps them in the same file):
the store finishes the job when the block ends, and a job row changed under it made that
completion fail, the job go back to its queue and the same block run again, for ever.
The block's end then reports the refusal, as a permanent error, after rolling
everything back. (Enqueueing stays allowed: ``enqueue(..., connection=conn)`` writes
its job rows as the store, under :meth:`BlockGuard.ours`.)
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

from .._errors import NotSupportedError

__all__ = ["BlockGuard"]


class BlockGuard:
    """Install on a connection whose transaction a block holds; :attr:`ended` names the
    statement it tried and was refused, if any."""

    __slots__ = ("_ours", "ended", "transaction")

    def __init__(self) -> None:
        #: What the block tried and was refused (``COMMIT``, ``an UPDATE of …``).
        self.ended: str | None = None
        #: Whether that was a transaction statement (else a change to the store's rows).
        self.transaction = False
        self._ours = 0

    def install(self, conn: sqlite3.Connection) -> None:
        """Refuse transaction statements on ``conn`` until :meth:`remove`."""
        conn.set_authorizer(self._authorize)

    @staticmethod
    def remove(conn: sqlite3.Connection) -> None:
        """Let ``conn`` end its transaction again (the block is over)."""
        conn.set_authorizer(None)

    @contextlib.contextmanager
    def ours(self) -> Iterator[None]:
        """The store itself writes its rows inside the block (an enqueue with
        ``connection=conn``): allowed while this lasts."""
        self._ours += 1
        try:
            yield
        finally:
            self._ours -= 1

    def _authorize(self, action: int, arg1: str | None, *_: str | None) -> int:
        if action == sqlite3.SQLITE_TRANSACTION:
            self.ended, self.transaction = arg1 or "COMMIT", True
            return sqlite3.SQLITE_DENY
        if action in _CHANGES and arg1 in _OWN_ROWS and not self._ours:
            self.ended, self.transaction = f"{_CHANGES[action]} of {arg1}", False
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def refusal(self) -> NotSupportedError:
        """The error the block's end raises when it tried what it may not."""
        if self.transaction:
            why = (
                "leaving the block commits its writes together with the job's completion "
                "(an exception in it rolls them back)"
            )
        else:
            why = "tokenline's own rows are the store's to change: it finishes the job"
        return NotSupportedError(
            f"{self.ended} inside `with ctx.transaction()` is refused: {why}; nothing was written"
        )


#: What the block may not do to :data:`_OWN_ROWS`, by SQLite's authorizer action (an
#: INSERT too: ``INSERT OR REPLACE`` replaces a row without asking about a DELETE).
_CHANGES = {
    sqlite3.SQLITE_INSERT: "an INSERT",
    sqlite3.SQLITE_UPDATE: "an UPDATE",
    sqlite3.SQLITE_DELETE: "a DELETE",
}
#: The store's tables whose rows the block may not change.
_OWN_ROWS = frozenset({"tokenline_jobs", "tokenline_attempts"})
