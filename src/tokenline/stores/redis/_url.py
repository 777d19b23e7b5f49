"""From a ``redis://`` URL to what the Redis store connects to and where its keys live.

``redis://[user:password@]host[:port][/db][?prefix=name&option=value…]``, ``rediss://``
for TLS. ``prefix`` is ours (default ``tokenline``); every other query parameter must
be one of the redis-py connection options in :data:`OPTIONS`. Each is checked and typed
here and handed to the client as a keyword argument, so a misspelt or malformed one is
a :class:`ConfigError` naming it when the store is built, not a redis-py traceback when
it first connects, and never a setting dropped without a word. Options given in the URL
win over the store's own (its timeout), as libpq's do on PostgreSQL.
"""

from __future__ import annotations

import difflib
import math
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..._errors import ConfigError
from .._port import check_port

__all__ = ["DEFAULT_PREFIX", "OPTIONS", "RedisTarget", "parse_redis_url"]

#: What a TLS target's ``where`` ends with.
TLS_MARK = " (TLS)"

DEFAULT_PREFIX = "tokenline"

_WHOLE = re.compile(r"[0-9]+")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _seconds(value: str) -> float | None:
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def _flag(value: str) -> bool | None:
    # redis-py's own parser reads any word it does not know as true ("off" too): only
    # the words that say which are taken.
    word = value.lower()
    return True if word in _TRUE else False if word in _FALSE else None


def _whole(least: int) -> Callable[[str], int | None]:
    def parse(value: str) -> int | None:
        return int(value) if _WHOLE.fullmatch(value) and int(value) >= least else None

    return parse


#: The connection options a Redis URL may carry: name -> (parser, what it wants). Those
#: of redis-py's URL options that the store's client takes on every redis-py it supports
#: (5 to 7): ``timeout`` is for a blocking pool, which the store does not use, and the
#: TLS verify flags came after redis-py 5.
OPTIONS: Mapping[str, tuple[Callable[[str], Any], str]] = {
    "db": (_whole(0), "a database number, 0 or more"),
    "socket_timeout": (_seconds, "a number of seconds above 0"),
    "socket_connect_timeout": (_seconds, "a number of seconds above 0"),
    "socket_keepalive": (_flag, "true or false"),
    "health_check_interval": (_whole(0), "a whole number of seconds, 0 or more"),
    "max_connections": (_whole(1), "a whole number, 1 or more"),
    "ssl_check_hostname": (_flag, "true or false"),
}
_TLS_ONLY = frozenset({"ssl_check_hostname"})
# Options redis-py reads that the store must not get: a resent script may already have
# run on the server (a lost answer is not a lost command), so an enqueue would be
# stored twice, a finish refused as stale.
_RESENDING = frozenset({"retry_on_timeout", "retry_on_error"})


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis URL: where to connect, with which options, under which prefix."""

    #: The URL redis-py connects to: scheme, credentials, host, port and db; no query.
    connect: str
    #: The start of every key of the store, ``{name}:`` (one Redis Cluster hash slot).
    prefix: str
    #: ``host:port/db``, for messages (never the password).
    #: ``host:port/db``, and `` (TLS)`` for ``rediss://``: for messages, never a password.
    where: str
    #: The URL's connection options, typed, as keyword arguments of redis-py's client.
    options: Mapping[str, Any]


def parse_redis_url(url: str) -> RedisTarget:
    """Parse and check ``url``; :class:`ConfigError` naming the part that is wrong: the
    scheme, the port, the db, the key prefix, or a query parameter (unknown, given twice,
    empty, or with a value of the wrong type)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError("url", f"not a Redis URL: {url!r} (use redis://host:port/db)")
    # Read as written, as urllib splits it: its own check takes 0, which the client
    # then read as the default port, and words its refusals as Python's.
    written = parts.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2]
    port = check_port(written, "Redis") if written else 6379
    query = _query(parts.query)
    name = query.pop("prefix", DEFAULT_PREFIX)
    _check_prefix(name)
    options: dict[str, Any] = {}
    for key, value in query.items():
        options[key] = _option(key, value, tls=parts.scheme == "rediss")
    db = _db(urllib.parse.unquote(parts.path), options.pop("db", None))
    connect = urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"/{db}", "", ""))
    where = f"{parts.hostname or '127.0.0.1'}:{port}/{db}"
    if parts.scheme == "rediss":
        where += TLS_MARK  # said in errors: a plain server never finishes the handshake
    return RedisTarget(connect=connect, prefix="{" + name + "}:", where=where, options=options)


def _query(text: str) -> dict[str, str]:
    query: dict[str, str] = {}
    for key, value in urllib.parse.parse_qsl(text, keep_blank_values=True):
        if key in query:
            raise ConfigError(
                "url", f"the Redis URL parameter {key!r} is given more than once: give it once"
            )
        query[key] = value
    return query


def _check_prefix(name: str) -> None:
    if not name:
        raise ConfigError(
            "url",
            "invalid Redis key prefix '': it is empty (prefix= with no name); give a "
            f"name, or leave prefix out for the default, {DEFAULT_PREFIX}",
        )
    if any(c in name for c in "{}\r\n\t "):
        raise ConfigError(
            "url", f"invalid Redis key prefix {name!r}: it may hold no braces or whitespace"
        )


def _option(key: str, value: str, *, tls: bool) -> Any:
    if key in _RESENDING:
        raise ConfigError(
            "url",
            f"the Redis URL parameter {key!r} is refused: tokenline never resends a "
            "command whose answer was lost, as the server may have run it already",
        )
    if key not in OPTIONS:
        raise ConfigError("url", f"unknown Redis URL parameter {key!r}{_suggest(key)}")
    if key in _TLS_ONLY and not tls:
        raise ConfigError("url", f"the Redis URL parameter {key!r} is for TLS only: use rediss://")
    parse, wanted = OPTIONS[key]
    typed = parse(value)
    if typed is None:
        got = "no value" if not value else f"{value!r}"
        raise ConfigError("url", f"the Redis URL parameter {key!r} wants {wanted}, got {got}")
    return typed


def _suggest(key: str) -> str:
    known = ["prefix", *OPTIONS]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; a Redis URL takes {', '.join(known)}"


def _db(path: str, given: int | None) -> int:
    """The database number of the URL's path (``/5``) or its ``db`` parameter."""
    number = path.removeprefix("/")
    if not number:
        return 0 if given is None else given
    if not _WHOLE.fullmatch(number):
        raise ConfigError(
            "url",
            f"the Redis URL's database {path!r} is not a database number: use /0, /1, …",
        )
    if given is not None and given != int(number):
        raise ConfigError(
            "url",
            f"the Redis URL names two databases, {path!r} and db={given}: give one",
        )
    return int(number)
