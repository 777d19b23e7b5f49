"""From a ``postgresql://`` URL to what the store connects to and where its tables live.

The URL is libpq's, plus one parameter of ours: ``?schema=name`` (default
``tokenline``). It is stripped before libpq sees the URL, validated against a strict
pattern, and only ever reaches SQL through :class:`psycopg.sql.Identifier`. Several
applications can share one database by using different schemas.
"""

from __future__ import annotations

import getpass
import math
import os
import re
from dataclasses import dataclass
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..._errors import ConfigError
from .._port import check_port

__all__ = ["DEFAULT_SCHEMA", "Target", "libpq_url", "parse_url"]

DEFAULT_SCHEMA = "tokenline"

#: Lower-case, unquoted-identifier style; short enough that the notification channel
#: ``tokenline_<schema>`` stays within PostgreSQL's 63-byte identifier limit.
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,49}")


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed store URL: the libpq conninfo, the schema, and names for messages."""

    #: libpq conninfo with tokenline's defaults (timeouts, application name) merged in.
    conninfo: str
    schema: str
    host: str
    port: str
    dbname: str
    user: str

    @property
    def channel(self) -> str:
        """The LISTEN/NOTIFY channel on which enqueues of this schema are announced."""
        return f"tokenline_{self.schema}"

    @property
    def where(self) -> str:
        """``database 'x' on host:port``, for error messages (never the password)."""
        return f"database {self.dbname!r} on {self.host}:{self.port}"


def _split_schema(url: str) -> tuple[str, str]:
    """``url`` without its ``schema`` query parameter, and that parameter's value.

    Other parameters are kept byte for byte, so libpq decodes them as it always does.
    """
    url = url.partition("#")[0]
    base, sep, query = url.partition("?")
    kept: list[str] = []
    found: list[str] = []
    for item in query.split("&") if sep else []:
        key, _, value = item.partition("=")
        if unquote(key) == "schema":
            found.append(unquote(value))
        elif item:
            kept.append(item)
    if len(found) > 1:
        raise ConfigError("url", "the schema parameter is given more than once")
    schema = found[0] if found else DEFAULT_SCHEMA
    if not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigError(
            "url",
            f"schema {schema!r} is not a valid tokenline schema name: use 1 to 50 "
            "lower-case letters, digits or underscores, not starting with a digit",
        )
    if schema == "information_schema" or schema.startswith("pg_"):
        # PostgreSQL's own: pg_dump leaves information_schema out of every dump (the
        # jobs with it), and refuses pg_ names only when the schema is created.
        raise ConfigError(
            "url",
            f"schema {schema!r} is one of PostgreSQL's own (information_schema and pg_… "
            "are the system's, and backups leave them out): name a schema of your own",
        )
    return base + ("?" + "&".join(kept) if kept else ""), schema


def libpq_url(url: str) -> str:
    """``url`` as libpq (``psycopg.connect``) takes it: without tokenline's ``schema``.

    For your own connections to the store's database, the outbox among them
    (``app.enqueue(..., connection=conn)``): libpq refuses the unknown ``schema``
    parameter, and tokenline names its tables with the schema itself, so the connection
    needs no ``search_path``::

        with psycopg.connect(libpq_url(app.url)) as conn, conn.transaction():
            app.enqueue(send_invoice, 42, connection=conn)
    """
    return _split_schema(url)[0]


def parse_url(url: str, *, timeout: float) -> Target:
    """Parse ``url`` and merge in the connection settings derived from ``timeout``.

    ``connect_timeout`` (whole seconds, at least 2, as libpq wants) bounds each
    connection attempt; ``statement_timeout`` bounds each statement on the server, so a
    stuck query fails with an error instead of blocking a worker. Values already in the
    URL win.
    """
    if timeout <= 0:
        raise ConfigError("timeout", f"must be > 0 seconds, got {timeout!r}")
    libpq_url, schema = _split_schema(url)
    try:
        params = conninfo_to_dict(libpq_url)
    except psycopg.ProgrammingError as exc:
        raise ConfigError("url", f"not a valid PostgreSQL URL: {exc}") from None
    # libpq checks a port only as it connects, and says "connection is bad", read as an
    # outage. One per host of a list (host=a,b&port=5432,5433); an empty one is the
    # default port.
    for port in str(params.get("port") or "").split(","):
        if port:
            check_port(port, "PostgreSQL")
    params.setdefault("connect_timeout", str(max(2, math.ceil(timeout))))
    params.setdefault("application_name", "tokenline")
    # Ours first: a statement_timeout the user put in the URL's options comes later and wins.
    statement_ms = max(1, round(timeout * 1000))
    # A client cut off inside a fenced transaction (a partition) leaves its session idle
    # in the transaction, holding the job's row lock: nobody can rescue that job until
    # the server drops the session, which its TCP keepalives take hours to do. Bound it
    # like the store's own deadline (2 x timeout + 1 s), found by the drill.
    idle_ms = max(1, round((2 * timeout + 1) * 1000))
    ours = f"-c statement_timeout={statement_ms} -c idle_in_transaction_session_timeout={idle_ms}"
    params["options"] = f"{ours} {params.get('options', '')}".strip()
    # Keepalives notice a peer that vanished without closing the socket (a partition).
    params.setdefault("keepalives", "1")
    params.setdefault("keepalives_idle", str(max(1, math.ceil(timeout))))
    params.setdefault("keepalives_interval", "2")
    params.setdefault("keepalives_count", "3")
    user = str(params.get("user") or os.environ.get("PGUSER") or getpass.getuser())
    return Target(
        conninfo=make_conninfo("", **params),
        schema=schema,
        host=str(params.get("host") or os.environ.get("PGHOST") or "localhost"),
        port=str(params.get("port") or os.environ.get("PGPORT") or "5432"),
        dbname=str(params.get("dbname") or os.environ.get("PGDATABASE") or user),
        user=user,
    )
