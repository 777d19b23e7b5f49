"""Shared fixtures: the fake clock and store factories for every backend."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from typing import NoReturn

import pytest

from tokenline._clock import FakeClock

#: In CI a missing service is a failure, never a skip.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

POSTGRES_URL = os.environ.get(
    "TOKENLINE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)

REDIS_URL = os.environ.get("TOKENLINE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

# The CLI fits its tables to COLUMNS: the width of whatever terminal runs the tests (or
# the 80 that pytest-xdist sets for its workers) must not decide what a test sees. A
# test about narrow output sets COLUMNS itself.
for _size in ("COLUMNS", "LINES"):
    os.environ.pop(_size, None)

# A suite started in the background by a shell without job control (`cmd &` in a
# script) inherits SIGINT ignored, and so does every process it starts: a test that
# stops a command with SIGINT, as Ctrl-C would, then waited for an exit that never came.
# The suite's processes take SIGINT as a terminal delivers it, however they were started.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def unavailable(reason: str) -> NoReturn:
    """Skip with ``reason``, or fail in CI, where a missing service is an error."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The test server's URL; skips (fails in CI) when it cannot be reached."""
    try:
        import psycopg
    except ModuleNotFoundError:
        unavailable("psycopg is not installed: pip install 'tokenline[postgres]'")
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=3):
            pass
    except psycopg.Error as exc:
        unavailable(
            f"PostgreSQL for tests is unreachable ({exc}); "
            "set TOKENLINE_TEST_POSTGRES_URL to a server you can create schemas on"
        )
    return POSTGRES_URL


@pytest.fixture
def absent_schema(postgres_server: str) -> Iterator[str]:
    """A schema name no test has used; dropped afterwards if anything created it."""
    import psycopg

    schema = f"tl_absent_{secrets.token_hex(6)}"
    yield schema
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture(scope="session")
def redis_server() -> str:
    """The test Redis server's URL; skips (fails in CI) when it cannot be reached."""
    try:
        import redis
    except ModuleNotFoundError:
        unavailable("redis-py is not installed: pip install 'tokenline[redis]'")
    try:
        with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3) as client:
            client.ping()
    except redis.RedisError as exc:
        unavailable(
            f"Redis for tests is unreachable ({exc}); set TOKENLINE_TEST_REDIS_URL to a "
            "server tests may write keys to"
        )
    return REDIS_URL


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    """The ``redis-server`` program, for tests that start their own servers (a primary
    and a replica); skips (fails in CI) when it is not installed."""
    import shutil

    found = shutil.which("redis-server")
    if found is None:
        unavailable("redis-server is not installed (Debian package redis-server)")
    return found


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """A store URL on the test Redis server with a fresh key prefix; the prefix's keys
    are deleted afterwards, so tests never see each other's keys."""
    import redis

    name = f"tl_test_{secrets.token_hex(6)}"
    sep = "&" if "?" in redis_server else "?"
    yield f"{redis_server}{sep}prefix={name}"
    with redis.Redis.from_url(redis_server) as client:
        keys = list(client.scan_iter(match=f"{{{name}}}:*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test advances it."""
    return FakeClock()


@pytest.fixture(scope="session")
def libfaketime() -> str:
    """Debian's libfaketime (multi-threaded), to preload into a process whose clock a
    test shifts; skips (fails in CI) when it is not installed. Preloaded directly, not
    through the ``faketime`` wrapper, so the test's process id is the worker's own."""
    import glob

    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    if not found:
        unavailable("libfaketime is not installed (Debian package faketime)")
    return found[0]


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium (or ``TOKENLINE_TEST_CHROMIUM``) for Playwright to drive;
    skips (fails in CI) when it or Playwright is missing. Playwright's own browser
    download is never used."""
    path = os.environ.get("TOKENLINE_TEST_CHROMIUM", "/usr/bin/chromium")
    try:
        import playwright  # noqa: F401
    except ModuleNotFoundError:
        unavailable("playwright is not installed: pip install -e '.[dev]'")
    if not os.path.exists(path):
        unavailable(f"no Chromium at {path}: apt-get install chromium")
    return path
