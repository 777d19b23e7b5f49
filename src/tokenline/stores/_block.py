"""The block of a fenced transaction on a ``sqlite3`` connection may not end it.

``with ctx.transaction() as conn:`` hands the handler the connection inside the open
transaction. A commit inside the block would make the handler's writes durable
without the job's completion, and a failure after it would run them again; a rollback
would let the block's later statements commit one by one. So while the block runs,
every statement that would end the transaction (``COMMIT``, ``END``, ``ROLLBACK``,
``conn.commit()``, ``conn.rollback()``, the commit that ``executescript`` begins with)
is refused by SQLite itself: it asks the connection's authorizer before compiling any
statement. Savepoints stay allowed: they never end the transaction. Nor may the block
change or delete tokenline's own job rows (SQLite's store keeps them in the same file):
the store finishes the job when the block ends, and a job row changed under it made that
completion fail, the job go back to its queue and the same block run again, for ever.
The block's end then reports the refusal, as a permanent error, after rolling
everything back. (Inserting jobs stays allowed: ``enqueue(..., connection=conn)``.)
"""

from __future__ import annotations

import sqlite3

from .._errors import NotSupportedError

__all__ = ["BlockGuard"]


class BlockGuard:
    """Install on a connection whose transaction a block holds; :attr:`ended` names the
    statement it tried and was refused, if any."""

    __slots__ = ("ended",)

    def __init__(self) -> None:
        #: The transaction statement the block tried (``COMMIT``, ``ROLLBACK``), refused.
        self.ended: str | None = None

    def install(self, conn: sqlite3.Connection) -> None:
        """Refuse transaction statements on ``conn`` until :meth:`remove`."""
        conn.set_authorizer(self._authorize)

    @staticmethod
    def remove(conn: sqlite3.Connection) -> None:
        """Let ``conn`` end its transaction again (the block is over)."""
        conn.set_authorizer(None)

    def _authorize(self, action: int, arg1: str | None, *_: str | None) -> int:
        if action == sqlite3.SQLITE_TRANSACTION:
            self.ended = arg1 or "COMMIT"
            return sqlite3.SQLITE_DENY
        if action in _CHANGES and arg1 in _OWN_ROWS:
            self.ended = f"{_CHANGES[action]} of {arg1}"
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def refusal(self) -> NotSupportedError:
        """The error the block's end raises when it tried what it may not."""
        if self.ended in ("COMMIT", "ROLLBACK"):
            why = (
                "leaving the block commits its writes together with the job's completion "
                "(an exception in it rolls them back)"
            )
        else:
            why = "tokenline's own rows are the store's to change: it finishes the job"
        return NotSupportedError(
            f"{self.ended} inside `with ctx.transaction()` is refused: {why}; nothing was written"
        )


#: What the block may not do to :data:`_OWN_ROWS`, by SQLite's authorizer action.
_CHANGES = {sqlite3.SQLITE_UPDATE: "an UPDATE", sqlite3.SQLITE_DELETE: "a DELETE"}
#: The store's tables whose rows the block may not change.
_OWN_ROWS = frozenset({"tokenline_jobs", "tokenline_attempts"})
