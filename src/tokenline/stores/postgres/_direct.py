"""One prepared statement on a blocking connection, through its libpq handle.

A single ``app.enqueue`` from web code is one short statement whose round trip is
mostly the server's commit, and the caller's thread waits for all of it, the client's
own work included. psycopg's cursor around that statement (adapting each parameter, its
cache of prepared statements, the result and its loaders, a wait that polls with a
timeout) cost the client about 40 µs of CPU per enqueue more than sending the same
prepared statement through the connection's ``pgconn``: 152 against 112 µs, and 2,495
against 2,764 enqueues a second (2 cores, the server on the same machine).

:func:`run` sends such a statement that way: prepared once per connection under a name
of its own, its parameters as text, its answer read as text, the socket waited on with
``poll`` and no timeout (a connection that must not wait for ever is armed in
``_cutoff.py``, whose shutdown of the socket wakes the wait). An error answer is raised
as psycopg's own exception for it, so that callers translate it as any other; a
connection that fails leaves libpq's status bad, and the pool discards it when it comes
back. Only values whose text form is unambiguous are sent this way, and only on a
session whose client encoding is UTF-8: otherwise :func:`run` answers ``None`` and the
caller takes psycopg's path.
"""

from __future__ import annotations

import math
import select
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import pq
from psycopg.errors import error_from_result

from ._raw import RawStatement

__all__ = ["run"]


def _text(value: Any) -> bytes | bool | None:
    """``value`` in PostgreSQL's text form, or ``False`` when it has no unambiguous one
    here (the caller's path through psycopg then adapts it)."""
    kind = type(value)
    if value is None:
        return None
    if kind is str:
        if "\x00" in value:
            return False  # refused by psycopg, with its own message
        return bytes(value, "utf-8")
    if kind is bool:
        return b"t" if value else b"f"
    if kind is int:
        return b"%d" % value
    if kind is float:
        # repr gives the shortest text that reads back as the same double; NaN and the
        # infinities are spelled differently by the two sides.
        return repr(value).encode() if math.isfinite(value) else False
    return False


def _wait(pgconn: pq.abc.PGconn) -> None:
    """Send what is buffered, then read until a result can be taken without waiting:
    never a blocking ``get_result``, which would wait holding the thread."""
    fd = pgconn.socket
    poller = select.poll()
    while pgconn.flush():  # 1: more to send, once the socket can take it
        poller.register(fd, select.POLLOUT | select.POLLIN)
        poller.poll()
        pgconn.consume_input()  # the server may answer early (an error) meanwhile
    poller.register(fd, select.POLLIN)
    while pgconn.is_busy():
        poller.poll()
        pgconn.consume_input()


def _results(pgconn: pq.abc.PGconn, encoding: str) -> pq.abc.PGresult:
    """The statement's result, once its whole answer is in: every part of it is read,
    for an error may follow the rows. An error is raised as psycopg's exception for it
    (the statement's transaction rolled back: a deferred check that failed at the
    commit comes after the rows it refused). One that ended the session after the rows
    came (``pg_terminate_backend``, a shutdown) is raised as a connection error, which
    says that the statement's fate is unknown: taking the rows for a commit returned
    ids of jobs that were never stored."""
    results = []
    while True:
        _wait(pgconn)
        if (more := pgconn.get_result()) is None:
            break
        results.append(more)
    if not results:  # the connection went away between the answer's parts
        raise psycopg.OperationalError(
            pgconn.get_error_message(encoding) or "the server sent no answer"
        )
    for n, result in enumerate(results):
        if result.status == pq.ExecStatus.FATAL_ERROR:
            error = error_from_result(result, encoding)
            severity = result.error_field(pq.DiagnosticField.SEVERITY_NONLOCALIZED)
            if n and severity in (b"FATAL", b"PANIC"):
                raise psycopg.OperationalError(
                    f"the session ended after the statement answered ({error})"
                ) from error
            raise error
    return results[0]


def _prepare(conn: Any, name: bytes, statement: RawStatement, encoding: str) -> None:
    conn.pgconn.send_prepare(name, statement.text)
    _results(conn.pgconn, encoding)
    conn.direct_prepared.add(name)


def run(
    conn: Any, name: bytes, statement: RawStatement, params: Mapping[str, Any]
) -> list[tuple[bytes | None, ...]] | None:
    """Execute ``statement`` (prepared on ``conn`` as ``name`` if it is not yet) with
    ``params`` on ``conn``, an idle autocommit connection of the caller's alone (a
    :class:`~._connect.RecordingConnection`, which keeps the names it prepared). The
    rows, every value as the server's text (``None`` for NULL). ``None``, the statement
    not run, if a parameter has no plain text form, if the session's client encoding is
    not UTF-8, or if the connection does not keep what it prepares (the caller then
    takes psycopg's path)."""
    encoding = conn.info.encoding
    if conn.direct_off or encoding != "utf-8":
        # Strings are sent as UTF-8: a session in another client encoding (a URL's
        # client_encoding, PGCLIENTENCODING) would store their bytes as its own.
        return None
    values = [_text(v) for v in statement.params(params)]
    if False in values:
        return None
    sent: list[bytes | None] = values  # type: ignore[assignment]  # False ruled out
    pgconn = conn.pgconn
    for again in (False, True):
        if name not in conn.direct_prepared:
            _prepare(conn, name, statement, encoding)
        pgconn.send_query_prepared(name, sent)
        try:
            result = _results(pgconn, encoding)
        except psycopg.errors.InvalidSqlStatementName:
            # The session lost it (a DISCARD ALL, or a pooler in front of the server,
            # dropped it) and nothing ran: prepared again, and sent once more.
            conn.direct_prepared.discard(name)
            if again:
                # Lost again at once: what stands between this connection and the
                # server (a pooler that hands each statement to another session) does
                # not keep prepared statements. psycopg's path from now on.
                conn.direct_off = True
                return None
            continue
        return [
            tuple(result.get_value(row, col) for col in range(result.nfields))
            for row in range(result.ntuples)
        ]
    raise AssertionError("unreachable")  # pragma: no cover
