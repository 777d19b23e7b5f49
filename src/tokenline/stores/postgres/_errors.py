"""psycopg and pool errors, translated into tokenline's tree in one place.

The message says what to do: which database is missing and how to create it, which
role lacks which privilege, whether the server was unreachable or only slow. Only
tokenline's own statements are translated; errors raised by a user's SQL inside a
fenced transaction reach the user as psycopg raised them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import TracebackType

import psycopg
from psycopg import errors as pg
from psycopg_pool import PoolClosed, PoolTimeout

from ..._errors import (
    InvalidInputError,
    StoreCorruptError,
    StoreError,
    StoreUnavailableError,
    TokenlineError,
    from_server,
)
from ._connect import last_failure
from ._target import Target

__all__ = [
    "READ_ONLY_SQLSTATE",
    "ReadOnlyServerError",
    "describe_connect_failure",
    "is_read_only",
    "map_postgres_errors",
    "maybe_made",
    "migration_refused",
    "read_only_message",
]

#: read_only_sql_transaction: a write refused by a server or session that accepts none.
READ_ONLY_SQLSTATE = "25006"


class ReadOnlyServerError(StoreUnavailableError):
    """The server, or this role's sessions on it, accept no writes: a hot standby, or
    ``default_transaction_read_only`` on for the role or the database. Unavailability,
    not a fault of the job: nothing was written, and the same write succeeds once the
    URL reaches a writable primary (``tokenline status`` reports it as refusing)."""

    #: As the server says it, for whoever reads the code off the error (status does).
    sqlstate = READ_ONLY_SQLSTATE
    changed_nothing = True


def read_only_message(target: Target, detail: str, *, standby: bool | None = None) -> str:
    """What a read-only server or session means for tokenline, and where to fix it;
    ``detail`` ends the message. ``standby``: whether the server said it is in
    recovery (``None``: not asked, either may be the cause)."""
    setting = (
        f"default_transaction_read_only is on for role {target.user!r} or database "
        f"{target.dbname!r}"
    )
    if standby:
        why = "it is a hot standby (in recovery)"
    elif standby is None:
        why = f"it is a hot standby, or {setting}"
    else:
        why = setting
    return (
        f"PostgreSQL {target.where} accepts no writes: {why}. Point the URL at the "
        "primary, or turn the setting off (ALTER ROLE … RESET "
        f"default_transaction_read_only); {detail}"
    )


def migration_refused(
    target: Target, version: int, wanted: int, exc: Exception
) -> StoreUnavailableError:
    """The error of a migration (from schema ``version`` to ``wanted``) the role may not
    make. A worker's role has the grants it needs at run time, on the schema's tables
    and sequences, not the ownership a migration's DDL needs: granting it more of those
    would not help."""
    text = " ".join(str(exc).split())
    if version == 0:
        state = "is not installed"
        need = (
            "the right to create the schema (GRANT CREATE ON DATABASE "
            f'"{target.dbname}" TO "{target.user}") or, when it exists, its owner: run '
            "`tokenline migrate` as a role that has it"
        )
    else:
        state = f"is at version {version}, this tokenline needs {wanted}"
        need = (
            "the schema's owner: run `tokenline migrate` as the role that owns it, then "
            "start workers with migration off (TOKENLINE_MIGRATE=0, or "
            "Settings(migrate=False)); at run time a role needs only USAGE on the "
            "schema, SELECT, INSERT, UPDATE and DELETE on its tables and USAGE and "
            "SELECT on its sequences"
        )
    return StoreUnavailableError(
        f"PostgreSQL role {target.user!r} may not migrate the tokenline schema "
        f"{target.schema!r} of {target.where}, which {state} ({text}). A migration "
        f"needs {need}"
    )


def is_read_only(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says the server or session accepts
    no writes: a refused write, or a standby refusing a read-write transaction. A
    connection that answered so is not reused: the next one the pool opens may reach
    a writable server (a failover, or the setting turned off)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "sqlstate", None) == READ_ONLY_SQLSTATE:
            return True
        if isinstance(current, pg.FeatureNotSupported) and "during recovery" in str(current):
            return True  # BEGIN READ WRITE on a standby
        current = current.__cause__ or current.__context__
    return False


def describe_connect_failure(exc: BaseException, target: Target) -> str:
    """A message for a failed connection that says the likely cause and the fix."""
    text = " ".join(str(exc).split())
    at = f"{target.host}:{target.port}"
    if f'database "{target.dbname}" does not exist' in text:
        return (
            f"PostgreSQL database {target.dbname!r} does not exist on {at}: create it "
            f"(createdb -h {target.host} -p {target.port} -U {target.user} {target.dbname}, "
            f'or CREATE DATABASE "{target.dbname}") or fix the database name in the URL'
        )
    if "role" in text and "does not exist" in text:
        return (
            f"PostgreSQL role {target.user!r} does not exist on {at}: create it "
            "(CREATE ROLE … LOGIN) or fix the user name in the URL"
        )
    if "password authentication failed" in text or "no password supplied" in text:
        return (
            f"PostgreSQL on {at} rejected the credentials of role {target.user!r}: check the "
            "password in the URL, PGPASSWORD or ~/.pgpass"
        )
    if "pg_hba.conf" in text:
        return (
            f"PostgreSQL on {at} does not accept connections from this host for role "
            f"{target.user!r} to database {target.dbname!r}: add a pg_hba.conf entry ({text})"
        )
    if "permission denied" in text or "privilege" in text:
        return (
            f"PostgreSQL role {target.user!r} lacks a privilege on {target.where}: "
            f'GRANT CONNECT ON DATABASE "{target.dbname}" TO "{target.user}" ({text})'
        )
    if "timeout expired" in text or "timed out" in text:
        return (
            f"PostgreSQL on {at} did not accept a connection in time: is the host right "
            f"and reachable, and the server not overloaded? ({text})"
        )
    if any(
        s in text
        for s in (
            "Connection refused",
            "could not translate host name",
            "failed to resolve host",
            "No route to host",
            "Network is unreachable",
            "No such file or directory",
        )
    ):
        return (
            f"cannot reach PostgreSQL at {at}: is the server running there, and are the "
            f"host and port in the URL right? ({text})"
        )
    return f"PostgreSQL {target.where} is unavailable: {text}"


def map_postgres_errors(target: Target, timeout: float) -> _Translating:
    """Translate psycopg, pool and timeout errors raised inside into tokenline's tree,
    each marked as PostgreSQL's (``StoreError.server``)."""
    return _Translating(target, timeout)


class _Translating:
    """:func:`map_postgres_errors`' context manager. A class, not a generator: every
    store call passes through one, most of them without an error, and entering and
    leaving a generator-based context manager cost a few microseconds each time, where
    this costs a fraction of one. An error goes through the translation below, raised
    again inside it."""

    __slots__ = ("_target", "_timeout")

    def __init__(self, target: Target, timeout: float) -> None:
        self._target = target
        self._timeout = timeout

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            return
        with from_server("PostgreSQL"), _translated(self._target, self._timeout):
            raise exc


@contextlib.contextmanager
def _translated(target: Target, timeout: float) -> Iterator[None]:
    try:
        yield
    except TokenlineError:
        raise
    except PoolTimeout as exc:
        why = last_failure(target.conninfo, within=max(2 * timeout, 10.0))
        raise StoreUnavailableError(
            f"no connection to PostgreSQL {target.where} within {timeout:g}s "
            + (
                # Not "refused": a connection that timed out (a black hole, a slow
                # link) fails this way too, and the reason says which it was.
                f"(the last try to connect failed: {why})"
                if why is not None
                else "(the server is unreachable, or every connection of the pool is busy)"
            )
        ) from exc
    except PoolClosed as exc:
        raise StoreError("the PostgreSQL store is closed; call open() first") from exc
    except pg.QueryCanceled as exc:
        # Not "within the store timeout": a statement_timeout in the URL's options wins
        # over tokenline's, and an operator's pg_cancel_backend ends a statement too.
        raise StoreUnavailableError(
            f"PostgreSQL {target.where} canceled a statement ({' '.join(str(exc).split())}); "
            f"tokenline's statement_timeout is the store timeout, {timeout:g}s, unless the "
            "URL's options set another"
        ) from exc
    except (pg.ReadOnlySqlTransaction, pg.FeatureNotSupported) as exc:
        if not is_read_only(exc):
            raise StoreError(f"PostgreSQL {target.where} refused an operation: {exc}") from exc
        # A coordination failure, as an unreachable server is: the write was refused
        # whole (nothing was written, no attempt is spent), and a worker drains and
        # tries again until the URL reaches a server that takes writes.
        detail = f"nothing was written ({' '.join(str(exc).split())})"
        raise ReadOnlyServerError(read_only_message(target, detail)) from exc
    except pg.InsufficientPrivilege as exc:
        raise StoreUnavailableError(
            f"PostgreSQL role {target.user!r} lacks a privilege tokenline needs on schema "
            f"{target.schema!r} of {target.where}: {exc}. Grant it what a worker needs "
            f'(GRANT USAGE ON SCHEMA "{target.schema}"; SELECT, INSERT, UPDATE, DELETE ON '
            "ALL TABLES IN SCHEMA it; USAGE, SELECT ON ALL SEQUENCES IN SCHEMA it), or "
            "use a role that has them"
        ) from exc
    except (pg.UndefinedTable, pg.UndefinedFunction, pg.InvalidSchemaName) as exc:
        raise StoreCorruptError(
            f"the tokenline schema {target.schema!r} of {target.where} is missing or "
            f"incomplete ({exc}): run `tokenline migrate`, which installs a missing schema "
            "and names what a damaged one lacks"
        ) from exc
    except pg.TransactionRollback as exc:
        # Deadlock or serialization failure: nothing was applied; trying again is safe.
        raise StoreUnavailableError(
            f"PostgreSQL {target.where} aborted a transaction on a conflict; retry: {exc}"
        ) from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise StoreUnavailableError(describe_connect_failure(exc, target)) from exc
    except psycopg.Error as exc:
        raise StoreError(f"PostgreSQL {target.where} refused an operation: {exc}") from exc
    except TimeoutError as exc:
        raise StoreUnavailableError(
            f"PostgreSQL {target.where} did not answer within the store timeout"
        ) from exc
    except UnicodeEncodeError as exc:
        # Raised by psycopg while it encodes the parameters, before anything is sent.
        raise InvalidInputError(
            f"{exc.object[exc.start : exc.end]!r} cannot be written in the client encoding "
            f"of the sessions with PostgreSQL {target.where} ({exc.encoding}); nothing was "
            "written. Connect with client_encoding=UTF8 (in the URL, or PGCLIENTENCODING)"
        ) from exc
    except OSError as exc:
        raise StoreUnavailableError(describe_connect_failure(exc, target)) from exc


def maybe_made(exc: StoreUnavailableError) -> bool:
    """Whether the statements that failed with ``exc``, once sent, may have been carried
    out: not when the server answered with an error of its own (a SQLSTATE: a statement
    timeout, a conflict), for then their transaction rolled back. A connection lost, or
    a deadline passed, before the answer came leaves it unknown."""
    cause = exc.__cause__
    return not (isinstance(cause, psycopg.Error) and cause.sqlstate is not None)
