"""Store URLs of the Redis store and the split topology: every form the README shows
parses, and a bad one is a ConfigError naming its culprit when the store is built, never
a redis-py traceback at the first connection nor a parameter dropped without a word."""

from __future__ import annotations

import re
import urllib.parse

import pytest
from click.testing import CliRunner
from redis import asyncio as aioredis

import tokenline
from tokenline import ConfigError
from tokenline.cli import main
from tokenline.stores import _split_parts, split_url, store_from_url
from tokenline.stores.redis import RedisStore
from tokenline.stores.redis._url import parse_redis_url
from tokenline.stores.split import SplitStore

BROKER = "redis://redis.internal:6379/0"
LEDGER = "postgresql://app@db.internal/app?schema=jobs"


def _split(broker: str, *extra: str) -> str:
    """A split URL with ``broker`` encoded as split_url does, then ``extra`` raw."""
    roles = urllib.parse.urlencode({"broker": broker, "ledger": LEDGER}, safe=":/@")
    return "&".join((f"split:?{roles}", *extra))


# -- the forms the README documents -----------------------------------------------------


def test_the_readme_split_app_parses() -> None:
    """App(broker=, leases=, ledger=) as the README writes it names one split URL that
    builds a split store on the default key prefix, db 0."""
    app = tokenline.App(broker=BROKER, leases=BROKER, ledger=LEDGER)
    store = store_from_url(app.url)
    assert isinstance(store, SplitStore)
    assert (store.redis.prefix, store.redis.where) == ("{tokenline}:", "redis.internal:6379/0")


@pytest.mark.parametrize(
    "url",
    [
        f"split:?broker={BROKER}&leases={BROKER}&ledger=postgresql://app@db.internal/app",
        f"split:?broker={BROKER}&ledger=postgresql://app@db.internal/app",
        split_url(f"{BROKER}?prefix=app", LEDGER),
        split_url("rediss://user:pw@redis.internal:6380/2?prefix=app", LEDGER),
    ],
)
def test_the_documented_split_urls_parse(url: str) -> None:
    """``split:?broker=…&leases=…&ledger=…`` with leases given or left out, and what
    split_url writes (a role's own options percent-encoded inside it), build a store."""
    assert isinstance(store_from_url(url), SplitStore)


def test_split_url_round_trips_through_its_parser() -> None:
    """What split_url writes reads back as the same role URLs, leases defaulting to the
    broker's."""
    broker = "redis://u:p%40ss@h:6379/3?prefix=app&socket_timeout=2"
    assert _split_parts(split_url(broker, LEDGER)) == (broker, broker, LEDGER)


@pytest.mark.parametrize(
    ("url", "prefix", "where", "connect"),
    [
        ("redis://h:6379/0?prefix=app", "{app}:", "h:6379/0", "redis://h:6379/0"),
        ("redis://h", "{tokenline}:", "h:6379/0", "redis://h/0"),
        ("redis://h/", "{tokenline}:", "h:6379/0", "redis://h/0"),
        ("redis://h:7000/15", "{tokenline}:", "h:7000/15", "redis://h:7000/15"),
        ("redis://h/?db=4", "{tokenline}:", "h:6379/4", "redis://h/4"),
        (
            "rediss://u:pw@h:6380/1?prefix=a.b-c",
            "{a.b-c}:",
            "h:6380/1 (TLS)",
            "rediss://u:pw@h:6380/1",
        ),
    ],
)
def test_good_redis_urls_parse(url: str, prefix: str, where: str, connect: str) -> None:
    """The key prefix and the server's printable name (no password) come from the URL;
    the URL redis-py gets carries no query, so nothing reaches it unchecked."""
    target = parse_redis_url(url)
    assert (target.prefix, target.where, target.connect) == (prefix, where, connect)


def test_connection_options_are_typed_and_win_over_the_store_timeout() -> None:
    """Each accepted option reaches the client typed (``off`` is false, which redis-py's
    own parser reads as true), and the URL's socket timeout wins over the store's."""
    url = (
        "rediss://h/0?socket_timeout=2.5&socket_connect_timeout=1&socket_keepalive=off"
        "&health_check_interval=0&max_connections=8&ssl_check_hostname=no"
    )
    store = RedisStore(url, timeout=10)
    assert store._client_options() == {
        "socket_timeout": 2.5,
        "socket_connect_timeout": 1.0,
        "decode_responses": False,
        "socket_keepalive": False,
        "health_check_interval": 0,
        "max_connections": 8,
        "ssl_check_hostname": False,
    }
    assert RedisStore("redis://h/0", timeout=3)._client_options()["socket_timeout"] == 3


@pytest.mark.parametrize(
    "url",
    [
        "redis://h/0?socket_timeout=1&socket_connect_timeout=1&socket_keepalive=true"
        "&health_check_interval=5&max_connections=4",
        "rediss://h/0?ssl_check_hostname=false&socket_timeout=1",
    ],
)
def test_every_accepted_option_is_one_the_client_takes(url: str) -> None:
    """A connection built with the options a URL may carry is built (the original bug:
    an option redis-py's connection does not take failed only there, as a TypeError)."""
    store = RedisStore(url)
    client = aioredis.Redis.from_url(store._target.connect, **store._client_options())
    client.connection_pool.make_connection()


# -- bad Redis URLs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("prefx=x", "unknown Redis URL parameter 'prefx' (did you mean 'prefix'?)"),
        ("decode_responses=true", "unknown Redis URL parameter 'decode_responses'"),
        ("timeout=3", "unknown Redis URL parameter 'timeout'"),
        ("socket_timeout=abc", "'socket_timeout' wants a number of seconds above 0, got 'abc'"),
        ("socket_timeout=0", "'socket_timeout' wants a number of seconds above 0, got '0'"),
        ("socket_timeout=nan", "'socket_timeout' wants a number of seconds above 0"),
        ("socket_connect_timeout=", "'socket_connect_timeout' wants a number of seconds"),
        ("socket_keepalive=maybe", "'socket_keepalive' wants true or false, got 'maybe'"),
        ("max_connections=0", "'max_connections' wants a whole number, 1 or more, got '0'"),
        ("health_check_interval=1.5", "'health_check_interval' wants a whole number"),
        ("db=-1", "'db' wants a database number, 0 or more, got '-1'"),
        ("retry_on_timeout=true", "'retry_on_timeout' is refused: tokenline never resends"),
        ("ssl_check_hostname=false", "'ssl_check_hostname' is for TLS only: use rediss://"),
        ("prefix=a&prefix=b", "'prefix' is given more than once"),
        ("prefix=", "invalid Redis key prefix '': it is empty"),
        ("db=3", "names two databases, '/5' and db=3"),
    ],
)
def test_a_bad_redis_query_parameter_is_named(query: str, says: str) -> None:
    """An unknown, repeated, empty, out-of-range or ill-typed parameter is a ConfigError
    naming it and what it wants, raised when the store is built."""
    with pytest.raises(ConfigError) as bad:
        RedisStore(f"redis://127.0.0.1:6379/5?{query}")
    assert bad.value.setting == "url"
    assert says in str(bad.value)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://h:6379/abc", "database '/abc' is not a database number"),
        ("redis://h:6379/-1", "database '/-1' is not a database number"),
        ("redis://h:6379/5/6", "database '/5/6' is not a database number"),
        ("redis://h:6379/%201", "database '/ 1' is not a database number"),
        ("redis://h:port/0", "port 'port' is not a port number"),
        ("redis://h:99999/0", "port '99999' is not a port number"),
        ("redis://h:0/0", "port '0' is not a port number"),
        ("redis://u:p@[::1]:+80/0", "port '+80' is not a port number"),
    ],
)
def test_a_bad_redis_db_or_port_is_named(url: str, says: str) -> None:
    """A database path that is not a non-negative whole number (once silently db 0) and
    a malformed port are refused, naming the part; port 0 was taken as 6379."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        RedisStore(url)


@pytest.mark.parametrize(
    ("url", "port"),
    [
        ("postgresql://u@127.0.0.1:99999/db?schema=wtc_x", "99999"),
        ("postgresql://u@127.0.0.1:0/db?schema=wtc_x", "0"),
        ("postgresql://u@127.0.0.1:abc/db?schema=wtc_x", "abc"),
        ("postgresql://u@127.0.0.1/db?schema=wtc_x&port=70000", "70000"),
        ("postgresql://u@/db?schema=wtc_x&host=a,b&port=5432,65536", "65536"),
    ],
)
def test_a_bad_postgres_port_is_a_bad_setting(url: str, port: str) -> None:
    """A port out of range or not a number reached libpq, which refused it only on
    connecting: the command said the server was unavailable (exit status 1), as in an
    outage. It is refused as the URL's mistake, naming the port, exit status 2."""
    from tokenline.stores.postgres import PostgresStore

    with pytest.raises(ConfigError, match=f"port {port!r} is not a port number") as bad:
        PostgresStore(url)
    assert bad.value.setting == "url"
    result = CliRunner().invoke(main, ["queues", "--url", url])
    assert result.exit_code == 2, result.output
    assert "invalid setting 'url'" in result.output
    assert "from 1 to 65535" in result.output
    assert "unavailable" not in result.output


def test_good_ports_are_taken() -> None:
    from tokenline.stores.postgres import PostgresStore

    assert PostgresStore("postgresql://u@h:65535/db?schema=wtc_x").target.port == "65535"
    assert PostgresStore("postgresql://u@/db?host=a,b&port=1,").target.port == "1,"
    assert parse_redis_url("redis://h:1/0").where == "h:1/0"
    assert parse_redis_url("redis://h/0").where == "h:6379/0"


def test_a_bad_broker_url_names_the_broker_role() -> None:
    """In the split topology the same checks run when the role is named, and the error
    names the broker: from App(broker=…) at once, and from a split URL when its store is
    built."""
    bad = f"{BROKER.removesuffix('/0')}/5?prefx=x"
    with pytest.raises(ConfigError, match="'prefx'") as raised:
        tokenline.App(broker=bad, ledger=LEDGER)
    assert raised.value.setting == "broker"
    with pytest.raises(ConfigError, match="'prefx'") as raised:
        store_from_url(_split(bad))
    assert raised.value.setting == "broker"


# -- bad split URLs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "setting", "says"),
    [
        ("ledgr=typo", "url", "unknown parameter 'ledgr': did you mean 'ledger'?"),
        ("lease=redis://10.0.0.1:1/0", "url", "unknown parameter 'lease': did you mean 'leases'?"),
        ("prefix=bbA_x", "url", "unknown parameter 'prefix': an option of a role's own URL"),
        ("broker=redis://other:6379/0", "broker", "gives broker= more than once"),
        ("ledger=postgresql://x/y", "ledger", "gives ledger= more than once"),
        ("leases=", "leases", "leases= is empty"),
    ],
)
def test_a_bad_split_parameter_is_named(extra: str, setting: str, says: str) -> None:
    """An unknown, repeated or empty parameter of a split URL is refused, naming it (and
    the accepted names for a misspelling), instead of being dropped: a dropped prefix
    put an app's keys under the default prefix of a Redis it shares."""
    url = _split(BROKER, extra)
    with pytest.raises(ConfigError) as bad:
        store_from_url(url)
    assert bad.value.setting == setting
    assert says in str(bad.value)
    if setting == "url":
        assert "it takes broker, leases, ledger" in str(bad.value)
    app = tokenline.App(url)
    with pytest.raises(ConfigError, match=says):
        app.open_store()


@pytest.mark.parametrize(
    ("url", "setting", "says"),
    [
        (f"split:?broker=&ledger={LEDGER}", "broker", "broker= is empty"),
        (f"split:?ledger={LEDGER}", "broker", "names no broker"),
        (f"split:?broker={BROKER}", "ledger", "names no ledger"),
        (f"split:extra?broker={BROKER}&ledger={LEDGER}", "url", "query parameters only"),
    ],
)
def test_a_split_url_without_a_role_is_refused(url: str, setting: str, says: str) -> None:
    """A role left out or empty, or text between ``split:`` and ``?``, is a ConfigError."""
    with pytest.raises(ConfigError, match=says) as bad:
        store_from_url(url)
    assert bad.value.setting == setting


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (_split("redis://127.0.0.1:6379/5?prefx=x"), "unknown Redis URL parameter 'prefx'"),
        (_split(BROKER, "ledgr=typo"), "unknown parameter 'ledgr'"),
    ],
)
def test_the_cli_reports_a_bad_split_url_in_one_line(url: str, says: str) -> None:
    """``tokenline status --url`` with a bad split URL exits 2 with the reason on one
    line, no traceback (it ended in redis-py's TypeError)."""
    result = CliRunner().invoke(main, ["status", "--url", url])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert says in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
