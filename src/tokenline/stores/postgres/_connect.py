"""Connections that remember why the last try to connect failed.

A pool that cannot open a connection (the role's ``CONNECTION LIMIT`` reached, the
server's ``max_connections``, a password changed) retries in the background and logs
the server's answer under psycopg's own logger; the caller waiting for a connection
only sees the pool's timeout, which said "the server is unreachable, or every
connection of the pool is busy" while the server was answering, and saying why. The
pools here connect through these classes, which keep the last failure per connection
string, so that the timeout's message can give the server's reason.
"""

from __future__ import annotations

import select
import time
from typing import Any

import psycopg
from psycopg import pq

__all__ = ["RecordingAsyncConnection", "RecordingConnection", "ended_while_idle", "last_failure"]

#: The last failure to connect, by connection string: when, and what the server said.
_FAILURES: dict[str, tuple[float, str]] = {}


def _record(conninfo: str, exc: BaseException) -> None:
    text = " ".join(str(exc).split()) or type(exc).__name__
    _FAILURES[conninfo] = (time.monotonic(), text)


def last_failure(conninfo: str, within: float) -> str | None:
    """What the last failed try to connect with ``conninfo`` said, if it failed within
    the last ``within`` seconds and no try has succeeded since."""
    found = _FAILURES.get(conninfo)
    if found is None or time.monotonic() - found[0] > within:
        return None
    return found[1]


class RecordingAsyncConnection(psycopg.AsyncConnection[Any]):
    """An async connection whose failures to connect are kept (see :func:`last_failure`)."""

    @classmethod
    async def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:
        """Connect as psycopg does, keeping the reason of a failure."""
        try:
            conn = await super().connect(conninfo, **kwargs)
        except psycopg.OperationalError as exc:
            _record(conninfo, exc)
            raise
        _FAILURES.pop(conninfo, None)
        return conn


class RecordingConnection(psycopg.Connection[Any]):
    """A blocking connection whose failures to connect are kept."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The statements ``_direct.run`` prepared on this connection, by name.
        self.direct_prepared: set[bytes] = set()
        #: ``_direct.run`` found that this connection does not keep prepared statements.
        self.direct_off = False

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:
        """Connect as psycopg does, keeping the reason of a failure."""
        try:
            conn = super().connect(conninfo, **kwargs)
        except psycopg.OperationalError as exc:
            _record(conninfo, exc)
            raise
        _FAILURES.pop(conninfo, None)
        return conn


def ended_while_idle(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether the server ended ``conn``'s session while it sat idle in its pool.

    A server that restarts, an operator's ``pg_terminate_backend`` and
    ``idle_session_timeout`` end idle sessions: the server writes why, and closes the
    socket. The pool hands such a connection out all the same, and the first statement
    sent on it failed, one call per connection the pool held. An idle connection has
    nothing to read: anything there (or a socket already closed) says it was ended,
    before anything was sent on it, so taking another connection instead is safe. One
    ``poll`` that does not wait, about a microsecond."""
    pgconn = conn.pgconn
    if pgconn.status != pq.ConnStatus.OK:
        return True
    try:
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError, psycopg.OperationalError):
        return True  # no socket to look at: it was closed
