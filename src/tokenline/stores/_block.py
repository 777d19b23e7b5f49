"""The block of a fenced transaction on a ``sqlite3`` connection may not end it.

``with ctx.transaction() as conn:`` hands the handler the connection inside the open
transaction. A commit inside the block would make the handler's writes durable
without the job's completion, and a failure after it would run them again; a rollback
would let the block's later statements commit one by one. So while the block runs,
every statement that would end the transaction (``COMMIT``, ``END``, ``ROLLBACK``,
``conn.commit()``, ``conn.rollback()``, the commit that ``executescript`` begins with)
is refused by SQLite itself: it asks the connection's authorizer before compiling any
statement. Savepoints stay allowed: they never end the transaction. Nor may the block
insert, change or delete tokenline's own rows (SQLite's store keeps them in the same file):
the store finishes the job when the block ends, and a job row changed under it made that
completion fail, the job go back to its queue and the same block run again, for ever;
an effect record deleted let the effect run again. Nor may it change the store's schema
(drop a trigger, create one), attach or detach databases, or set a pragma the store
relies on (its journal, locking, durability, schema version, waits and checks).
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

    def _authorize(
        self, action: int, arg1: str | None, arg2: str | None, db: str | None, *_: str | None
    ) -> int:
        if action == sqlite3.SQLITE_TRANSACTION:
            self.ended, self.transaction = arg1 or "COMMIT", True
            return sqlite3.SQLITE_DENY
        if self._ours:
            return sqlite3.SQLITE_OK
        refused: str | None = None
        if action in _CHANGES and (_is_own(arg1) or db == _COORD):
            refused = f"{_CHANGES[action]} of {arg1}"
        elif action in _SCHEMA and (_is_own(arg1) or _is_own(arg2) or db == _COORD):
            refused = f"{_SCHEMA[action]} {arg1}"
        elif action in _TRIGGERS:
            # Any trigger: fired later, from a connection of the user's own, its body
            # would run without this guard, and may change the store's rows.
            refused = f"CREATE TRIGGER {arg1}"
        elif action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
            refused = f"{'ATTACH' if action == sqlite3.SQLITE_ATTACH else 'DETACH'} {arg1}"
        elif action == sqlite3.SQLITE_PRAGMA and arg2 is not None and arg1 in _PRAGMAS:
            # Setting one of these changes what the store relies on; reading any, or
            # setting another, stays allowed.
            refused = f"PRAGMA {arg1} = {arg2}"
        if refused is None:
            return sqlite3.SQLITE_OK
        self.ended, self.transaction = refused, False
        return sqlite3.SQLITE_DENY

    def refusal(self) -> NotSupportedError:
        """The error the block's end raises when it tried what it may not."""
        if self.transaction:
            why = (
                "leaving the block commits its writes together with the job's completion "
                "(an exception in it rolls them back)"
            )
        else:
            why = (
                "tokenline's own rows and schema are the store's to change (it finishes "
                "the job; its ledger keeps effects once), and so are the connection's "
                "settings"
            )
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
#: What the block may not do to the store's tables, indexes and triggers, by SQLite's
#: authorizer action.
_SCHEMA = {
    sqlite3.SQLITE_CREATE_INDEX: "CREATE INDEX",
    sqlite3.SQLITE_CREATE_TABLE: "CREATE TABLE",
    sqlite3.SQLITE_CREATE_TRIGGER: "CREATE TRIGGER",
    sqlite3.SQLITE_CREATE_VIEW: "CREATE VIEW",
    sqlite3.SQLITE_DROP_INDEX: "DROP INDEX",
    sqlite3.SQLITE_DROP_TABLE: "DROP TABLE",
    sqlite3.SQLITE_DROP_TRIGGER: "DROP TRIGGER",
    sqlite3.SQLITE_DROP_VIEW: "DROP VIEW",
    sqlite3.SQLITE_ALTER_TABLE: "ALTER TABLE",
}
#: Creating a trigger, on any table.
_TRIGGERS = frozenset({sqlite3.SQLITE_CREATE_TRIGGER, sqlite3.SQLITE_CREATE_TEMP_TRIGGER})
#: The pragmas the block may not set: the file's journal, locking and durability, its
#: schema, and the connection's waits and checks that the store's statements count on.
_PRAGMAS = frozenset(
    {
        "journal_mode", "locking_mode", "synchronous", "writable_schema", "schema_version",
        "user_version", "foreign_keys", "busy_timeout", "query_only", "recursive_triggers",
        "trusted_schema", "defer_foreign_keys", "ignore_check_constraints",
    }
)  # fmt: skip
#: The coordination file's schema (leases, workers, the clock): all of it the store's.
_COORD = "coord"


def _is_own(name: str | None) -> bool:
    """Whether ``name`` is one of the store's tables (or its indexes and triggers):
    jobs and attempts, the ledger's effects, fences, unique keys and audit."""
    return name is not None and name.startswith("tokenline_")
