"""Connections lent to ``ctx.transaction()`` blocks: read-only outside tokenline's
transactions.

A block is handed a real psycopg connection, which goes back to a pool when the block
ends. A reference the block kept (a cursor, a thread it started, a global) would
otherwise still write through it afterwards: unfenced, outside the job, after its
lease may have passed to another worker. So the connections lent to blocks come from
pools of their own whose sessions run with ``default_transaction_read_only = on``: the
fenced transaction begins ``READ WRITE`` (psycopg's ``read_only = False``), and any
statement sent through a kept reference later runs read-only, its writes refused by the
server (``ReadOnlySqlTransaction``), cursors included.

Giving a connection back also undoes what a block may have left on its session for the
next job's block to inherit (:data:`RESET`): a ``SET ROLE`` or ``SET search_path``
(the next job would write as another role, or into another tenant's schema), a session
advisory lock (held by an idle pooled connection for ever: ownership that never
expires), temporary tables, held cursors and ``LISTEN``; then the read-only default is
set again. A block that commits runs this inside its transaction, before tokenline's
completion (which a ``SET ROLE`` or a tiny ``statement_timeout`` left by the block would
otherwise fail, for ever); other blocks when their connection is given back: one round
trip either way. The connection's Python-side ``row_factory`` is put back too.
Statements the block prepares itself are left (deallocating everything would drop the
store's own prepared statements too), and so are adapters or notice handlers it
registers on the connection: register those on a cursor.

Beyond reach, as with any connection the handler opens itself: a kept reference used
while the same connection is lent to another block joins that block's transaction, and
one that turns the setting off again by hand writes what it likes.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

__all__ = [
    "READ_ONLY",
    "RESET",
    "read_only_by_default",
    "read_only_by_default_async",
    "take_back",
    "take_back_async",
]

#: The session setting of a connection at rest in a lent pool.
READ_ONLY = "SET default_transaction_read_only = on"

#: What giving a connection back runs (one round trip, in the simple protocol): every
#: session setting back to the connection's own (its URL's ``options`` included), the
#: read-only default on again.
RESET = (
    "CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; UNLISTEN *; "
    "SELECT pg_advisory_unlock_all(); DISCARD TEMP; " + READ_ONLY
)


def read_only_by_default(conn: psycopg.Connection[Any]) -> None:
    """The lent sync pool's ``configure``: a new connection starts read-only."""
    conn.execute(READ_ONLY)


async def read_only_by_default_async(conn: AsyncConnection[Any]) -> None:
    """The lent async pool's ``configure``: a new connection starts read-only."""
    await conn.execute(READ_ONLY)


def take_back(conn: psycopg.Connection[Any], *, reset: bool = True) -> None:
    """Put ``conn`` back at rest: no transaction, autocommit, read-only by default, its
    session reset (``reset=False``: the committed transaction already did)."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        conn.rollback()
    conn.autocommit = True
    conn.read_only = None
    conn.row_factory = tuple_row  # what the pool's connections are made with
    if reset:
        conn.execute(RESET)


async def take_back_async(conn: AsyncConnection[Any], *, reset: bool = True) -> None:
    """:func:`take_back` for an async connection."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        await conn.rollback()
    await conn.set_autocommit(True)
    await conn.set_read_only(None)
    conn.row_factory = tuple_row
    if reset:
        await conn.execute(RESET)
