"""The ``store`` fixture: every contract test runs once per backend.

Backends join by adding a factory to ``BACKENDS``. A test marked ``ledger`` runs only on
the backends that play the ledger role (``LEDGER_BACKENDS``): the Redis store is a broker
and lease store only, and runs every other test. A backend whose service is missing is
skipped with the reason printed, except in CI (``CI=true``), where it fails.

PostgreSQL: the server named by ``TOKENLINE_TEST_POSTGRES_URL`` (default
``postgresql://postgres@127.0.0.1:5432/test``). Every test gets a fresh schema with a
random name, dropped afterwards, so tests never see each other's rows.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline.stores import MemoryStore, Store
from tokenline.stores.sqlite import SQLiteStore

# ``postgres_server`` (skip, or fail in CI, without a server) lives in tests/conftest.py.


def _memory(clock: FakeClock, tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    return MemoryStore(clock=clock)


def _sqlite(clock: FakeClock, tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    return SQLiteStore(f"sqlite:///{tmp_path / 'contract.db'}", clock=clock)


def _postgres(clock: FakeClock, tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    from tokenline.stores.postgres import PostgresStore

    # Fetched lazily so only postgres runs need the server; cached per test, so both
    # stores of ``store_pair`` share one schema.
    url: str = request.getfixturevalue("postgres_url")
    return PostgresStore(url, clock=clock)


def _redis(clock: FakeClock, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    from tokenline.stores.redis import RedisStore

    # A fresh key prefix per test, shared by both stores of ``store_pair``.
    url: str = request.getfixturevalue("redis_url")
    return RedisStore(url, clock=clock)


def _split(clock: FakeClock, tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    from tokenline.stores.split import SplitStore

    # Broker and leases on Redis, the ledger on PostgreSQL: both fetched per test, so
    # both stores of ``store_pair`` share one key prefix and one schema.
    broker: str = request.getfixturevalue("redis_url")
    ledger: str = request.getfixturevalue("postgres_url")
    return SplitStore(broker=broker, ledger=ledger, clock=clock)


BACKENDS: dict[str, Callable[[FakeClock, Path, pytest.FixtureRequest], Any]] = {
    "memory": _memory,
    "sqlite": _sqlite,
    "postgres": _postgres,
    "redis": _redis,
    "split": _split,
}
#: The backends that play the ledger role: the only ones a ``ledger`` test runs on.
LEDGER_BACKENDS = frozenset({"memory", "sqlite", "postgres", "split"})
#: The backends holding the jobs and the ledger in one store: the only ones a
#: ``one_store`` test runs on (the reconciler's checks that need both in one store).
ONE_STORE_BACKENDS = frozenset({"memory", "sqlite", "postgres"})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each test using ``store`` once per backend; a ``ledger`` test once per
    backend that plays the ledger role; a ``one_store`` test once per backend that
    holds the jobs and the ledger together."""
    if "store" not in metafunc.fixturenames:
        return
    names = sorted(BACKENDS)
    if metafunc.definition.get_closest_marker("ledger") is not None:
        names = [n for n in names if n in LEDGER_BACKENDS]
    if metafunc.definition.get_closest_marker("one_store") is not None:
        names = [n for n in names if n in ONE_STORE_BACKENDS]
    metafunc.parametrize("store", names, indirect=True)


@pytest.fixture
async def split(redis_url: str, postgres_url: str, clock: FakeClock) -> AsyncIterator[Any]:
    """An open split store (for the split topology's own tests): a fresh Redis key
    prefix and a fresh PostgreSQL schema."""
    from tokenline.stores.split import SplitStore

    store = SplitStore(broker=redis_url, ledger=postgres_url, clock=clock)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def postgres_schema(postgres_server: str) -> Iterator[str]:
    """A fresh schema name for this test; the schema is dropped afterwards."""
    import psycopg
    from psycopg import sql

    schema = f"tl_test_{secrets.token_hex(6)}"
    yield schema
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def postgres_url_for(base: str, schema: str) -> str:
    """``base`` with tokenline's ``schema`` parameter and that schema first on the
    search path, so a test's own unqualified tables land in it and are dropped too."""
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}schema={schema}&options=-c%20search_path%3D{schema}"


@pytest.fixture
async def admin(postgres_server: str) -> AsyncIterator[Any]:
    """A plain autocommit connection for inspecting and meddling with the database."""
    import psycopg

    conn = await psycopg.AsyncConnection.connect(postgres_server, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
def postgres_url(postgres_server: str, postgres_schema: str) -> str:
    """A store URL on the test server, in this test's own schema."""
    return postgres_url_for(postgres_server, postgres_schema)


@pytest.fixture
def postgres_url_via(postgres_schema: str) -> Callable[[str], str]:
    """Builds this test's store URL on another base URL (a relay in front of the server)."""
    return lambda base: postgres_url_for(base, postgres_schema)


@pytest.fixture
async def store(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> AsyncIterator[Any]:
    """An open, empty store of each backend, driven by the fake clock."""
    s = BACKENDS[request.param](clock, tmp_path, request)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def store_pair(
    request: pytest.FixtureRequest, store: Any, clock: FakeClock, tmp_path: Path
) -> AsyncIterator[tuple[Any, Any]]:
    """Two handles on the same data: two connections where the backend has them."""
    if not store.capabilities.multi_process:
        yield store, store
        return
    backend = request.node.callspec.params["store"]
    other = BACKENDS[backend](clock, tmp_path, request)
    await other.open()
    try:
        yield store, other
    finally:
        await other.close()
