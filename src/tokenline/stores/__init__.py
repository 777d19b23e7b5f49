"""Store backends behind one seam (:class:`~tokenline.stores.base.Store`).

``store_from_url`` picks the backend from the URL scheme and imports optional drivers
lazily, failing with an install hint when an extra is missing. The split topology (one
store per role) is one URL too, ``split:?broker=…&leases=…&ledger=…`` (see
:func:`split_url`), so that every command and worker process can be handed it whole.
"""

from __future__ import annotations

import difflib
import urllib.parse

from .._clock import Clock
from .._errors import ConfigError, NotSupportedError
from .base import Capabilities, FencedTransaction, ResourceLease, Store
from .memory import MemoryStore

__all__ = [
    "Capabilities",
    "FencedTransaction",
    "MemoryStore",
    "ResourceLease",
    "Store",
    "split_url",
    "store_from_url",
]


def split_url(broker: str, ledger: str, leases: str | None = None) -> str:
    """The URL of the split topology: broker and leases on Redis, the ledger on
    PostgreSQL. ``leases`` defaults to ``broker``; both roles share one Redis store.

    Raises :class:`ConfigError` naming the role whose URL is wrong: a wrong scheme, or
    a Redis URL with an unknown or malformed parameter, port or database.
    """
    leases = broker if leases is None else leases
    for role, url, schemes in (
        ("broker", broker, ("redis", "rediss")),
        ("leases", leases, ("redis", "rediss")),
        ("ledger", ledger, ("postgresql", "postgres")),
    ):
        scheme = url.split(":", 1)[0].lower() if isinstance(url, str) and ":" in url else ""
        if scheme not in schemes:
            wanted = "redis://host:port/db" if role != "ledger" else "postgresql://…"
            raise ConfigError(role, f"the split topology needs {wanted} here, got {url!r}")
    if leases != broker:
        raise ConfigError(
            "leases",
            "the broker and leases roles share one Redis store: give the same URL to both "
            f"(broker {broker!r}, leases {leases!r})",
        )
    _check_redis_url(broker)
    roles = {"broker": broker, "leases": leases, "ledger": ledger}
    query = urllib.parse.urlencode(roles, safe=":/@")
    return f"split:?{query}"


def _check_redis_url(broker: str) -> None:
    """Refuse a bad broker URL as a setting of the broker role, when it is named rather
    than when the store first connects."""
    try:
        from .redis._url import parse_redis_url
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on extras
        if exc.name and exc.name.startswith("redis"):
            return  # opening the store says which extra to install
        raise
    try:
        parse_redis_url(broker)
    except ConfigError as exc:
        raise ConfigError("broker", exc.reason) from None


#: The split URL's parameters, one per role.
_ROLES = ("broker", "leases", "ledger")


def _split_parts(url: str) -> tuple[str, str, str]:
    """The broker, leases and ledger URLs of a ``split:?…`` URL; :class:`ConfigError`
    for a parameter that is unknown, given twice or empty, or a role left out."""
    head, _, query = url.partition("?")
    if head.partition(":")[2].strip("/"):
        raise ConfigError(
            "url",
            f"the split URL takes its roles as query parameters only, got {head!r} before "
            "the '?' (see split_url)",
        )
    roles: dict[str, str] = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if key not in _ROLES:
            raise ConfigError("url", _unknown_split_key(key))
        if key in roles:
            raise ConfigError(key, f"the split URL gives {key}= more than once: give it once")
        if not value:
            # An empty leases= fell back to the broker's; an empty role is a mistake.
            raise ConfigError(key, f"the split URL's {key}= is empty: give its URL")
        roles[key] = value
    missing = [k for k in ("broker", "ledger") if k not in roles]
    if missing:
        raise ConfigError(
            missing[0], f"the split URL {url!r} names no {missing[0]} (see split_url)"
        )
    return roles["broker"], roles.get("leases", roles["broker"]), roles["ledger"]


def _unknown_split_key(key: str) -> str:
    close = difflib.get_close_matches(key, _ROLES, n=1)
    if close:
        hint = f"did you mean {close[0]!r}? "
    else:
        # The likely slip: a role's own option (a Redis prefix, a PostgreSQL schema)
        # written beside the roles instead of inside the role's URL.
        hint = (
            "an option of a role's own URL goes inside it, percent-encoded, as split_url "
            "writes it (broker=redis://host:6379/0%3Fprefix%3Dname); "
        )
    return f"the split URL has an unknown parameter {key!r}: {hint}it takes broker, leases, ledger"


def refuse_sqlite_url_options(url: str) -> None:
    """Refuse a ``sqlite:`` URL with a query string or a fragment: the SQLite store takes
    no parameters, and the text after a ``?`` or ``#`` silently became part of the file
    name (``q.db?foo=1``). :class:`ConfigError` naming the parameters, before anything is
    created on disk."""
    head, hashed, fragment = url.partition("#")
    _, asked, query = head.partition("?")
    if asked:
        names = dict.fromkeys(k for k, _ in urllib.parse.parse_qsl(query, keep_blank_values=True))
        given = (
            f"gives {'parameter' if len(names) == 1 else 'parameters'} "
            f"{', '.join(repr(n) for n in names)}"
            if names
            else f"has the query string {'?' + query!r}"
        )
        raise ConfigError(
            "url",
            f"SQLite URLs take no query parameters, but {url!r} {given}: leave out the "
            "'?' and what follows it (a file name cannot hold a '?')",
        )
    if hashed:
        raise ConfigError(
            "url",
            f"SQLite URLs take no #fragment, but {url!r} has {'#' + fragment!r}: leave out "
            "the '#' and what follows it (a file name cannot hold a '#')",
        )


def store_from_url(
    url: str, *, clock: Clock | None = None, timeout: float = 10.0, migrate: bool = True
) -> Store:
    """A new, unopened store for ``url`` (``sqlite:///…``, ``postgresql://…``, ``memory://``).

    It builds the store and nothing else: no setting or environment variable can hand
    back a wrapped or weakened one. ``clock`` replaces the store's own clock (tests).
    ``migrate=False``: a store with versioned migrations refuses an outdated schema
    instead of upgrading it on open (run ``tokenline migrate``).
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        refuse_sqlite_url_options(url)
        from .sqlite import SQLiteStore

        return SQLiteStore(url, clock=clock, timeout=timeout, migrate=migrate)
    if scheme == "memory":
        return MemoryStore(clock=clock)
    if scheme in ("postgresql", "postgres"):
        try:
            from .postgres import PostgresStore
        except ModuleNotFoundError as exc:  # pragma: no cover - depends on extras
            if exc.name and exc.name.startswith(("psycopg", "tokenline.stores.postgres")):
                raise NotSupportedError(
                    "the PostgreSQL store needs psycopg: pip install 'tokenline[postgres]'"
                ) from exc
            raise
        return PostgresStore(url, clock=clock, timeout=timeout, migrate=migrate)
    if scheme == "split":
        broker, leases, ledger = _split_parts(url)
        split_url(broker, ledger, leases)  # the same checks as when it was built
        try:
            from .split import SplitStore
        except ModuleNotFoundError as exc:  # pragma: no cover - depends on extras
            if exc.name and exc.name.startswith(("redis", "psycopg")):
                raise NotSupportedError(
                    "the split topology needs redis-py and psycopg: "
                    "pip install 'tokenline[redis,postgres]'"
                ) from exc
            raise
        return SplitStore(
            broker=broker, ledger=ledger, clock=clock, timeout=timeout, migrate=migrate
        )
    if scheme in ("redis", "rediss"):
        raise ConfigError(
            "url",
            f"{url!r} is a Redis URL: Redis plays the broker and leases roles only, never the "
            "ledger. Use the split topology: broker and leases on it, the ledger on "
            "PostgreSQL (App(broker=…, leases=…, ledger='postgresql://…'), or "
            "TOKENLINE_BROKER / TOKENLINE_LEASES / TOKENLINE_LEDGER)",
        )
    raise ConfigError(
        "url",
        f"unsupported store URL {url!r}: use sqlite:///path.db, postgresql://…, memory://, "
        "or the split topology (broker, leases, ledger)",
    )
