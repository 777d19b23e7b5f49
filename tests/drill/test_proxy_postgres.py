"""The fault proxy in front of the real PostgreSQL test server, driven with psycopg.

A client timeout here is what the PostgreSQL store does on every operation
(``run_bounded``): give up after a deadline, even when the server never answers.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tokenline._errors import StoreUnavailableError
from tokenline._jobs import NewJob
from tokenline.drill import FaultProxy, Faults
from tokenline.stores.postgres import PostgresStore
from tokenline.stores.postgres._deadline import run_bounded

pytestmark = pytest.mark.postgres

SLACK = 0.02


@pytest.fixture
async def proxy(postgres_server: str) -> AsyncIterator[FaultProxy]:
    """A fault proxy in front of the PostgreSQL test server."""
    params = conninfo_to_dict(postgres_server)
    upstream = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    async with FaultProxy(upstream=upstream, seed=3) as p:
        yield p


@pytest.fixture
def table(postgres_server: str) -> Iterator[sql.Identifier]:
    """A fresh table ``(n int)`` on the test server, dropped afterwards."""
    name = sql.Identifier(f"tl_drill_{secrets.token_hex(6)}")
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (n int)").format(name))
    yield name
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(name))


@pytest.fixture
def schema(postgres_server: str) -> Iterator[str]:
    """A fresh schema name for a store, dropped afterwards."""
    name = f"tl_drill_{secrets.token_hex(6)}"
    yield name
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def rows_in(postgres_server: str, table: sql.Identifier) -> list[int]:
    """The rows of ``table``, read directly (not through the proxy)."""
    with psycopg.connect(postgres_server) as conn:
        return [r[0] for r in conn.execute(sql.SQL("SELECT n FROM {}").format(table))]


async def connect(postgres_server: str, proxy: FaultProxy) -> Any:
    """An autocommit psycopg connection that goes through ``proxy``."""
    conninfo = make_conninfo(postgres_server, host="127.0.0.1", port=proxy.port)
    return await psycopg.AsyncConnection.connect(conninfo, autocommit=True, connect_timeout=5)


async def select_one(conn: Any, deadline: float = 10) -> Any:
    """``SELECT 1`` with a client-side deadline."""
    cur = await run_bounded(conn.execute("SELECT 1"), deadline)
    return (await cur.fetchone())[0]


async def test_queries_cross_a_clean_proxy(postgres_server: str, proxy: FaultProxy) -> None:
    """Connecting and querying through the proxy works and is counted."""
    async with await connect(postgres_server, proxy) as conn:
        assert await select_one(conn) == 1
    stats = proxy.stats
    assert stats.accepted == 1
    assert stats.bytes_to_server > 0
    assert stats.bytes_to_client > 0


async def test_blackhole_times_a_query_out_and_clear_heals(
    postgres_server: str, proxy: FaultProxy
) -> None:
    """Under a blackhole a query with a client timeout times out; once cleared a new
    connection queries again."""
    async with await connect(postgres_server, proxy) as conn:
        assert await select_one(conn) == 1
        proxy.set_faults(Faults(blackhole=True))
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await select_one(conn, deadline=0.5)
        assert time.monotonic() - started >= 0.5 - SLACK
        proxy.clear()
    async with await connect(postgres_server, proxy) as conn:
        assert await select_one(conn) == 1
    assert proxy.stats.bytes_dropped > 0


async def test_reset_breaks_the_connection(postgres_server: str, proxy: FaultProxy) -> None:
    """After a reset the client's next query fails with a connection error."""
    async with await connect(postgres_server, proxy) as conn:
        assert await select_one(conn) == 1
        assert proxy.reset() == 1
        with pytest.raises(psycopg.OperationalError):
            await select_one(conn)
    async with await connect(postgres_server, proxy) as conn:
        assert await select_one(conn) == 1


async def test_refuse_makes_connecting_fail(postgres_server: str, proxy: FaultProxy) -> None:
    """While refusing, connecting fails; afterwards it succeeds again."""
    proxy.set_faults(refuse=True)
    with pytest.raises(psycopg.OperationalError):
        await connect(postgres_server, proxy)
    proxy.clear()
    async with await connect(postgres_server, proxy) as conn:
        assert await select_one(conn) == 1
    assert proxy.stats.refused >= 1


async def test_latency_slows_every_round_trip(postgres_server: str, proxy: FaultProxy) -> None:
    """A query's round trip gains at least twice the added latency."""
    async with await connect(postgres_server, proxy) as conn:
        proxy.set_faults(latency=0.1, jitter=0.02)
        started = time.monotonic()
        assert await select_one(conn) == 1
        assert time.monotonic() - started >= 2 * (0.1 - 0.02) - SLACK


async def test_loss_to_client_loses_the_ack_of_an_applied_write(
    postgres_server: str, proxy: FaultProxy, table: sql.Identifier
) -> None:
    """With server→client loss an INSERT commits on the server while its client times
    out: the lost ack."""
    async with await connect(postgres_server, proxy) as conn:
        proxy.set_faults(drop_to_client=True)
        insert = sql.SQL("INSERT INTO {} VALUES (1)").format(table)
        with pytest.raises(TimeoutError):
            await run_bounded(conn.execute(insert), 0.5)
    assert rows_in(postgres_server, table) == [1]


async def test_loss_to_server_never_applies_the_write(
    postgres_server: str, proxy: FaultProxy, table: sql.Identifier
) -> None:
    """With client→server loss the INSERT never reaches the server."""
    async with await connect(postgres_server, proxy) as conn:
        proxy.set_faults(drop_to_server=True)
        insert = sql.SQL("INSERT INTO {} VALUES (2)").format(table)
        with pytest.raises(TimeoutError):
            await run_bounded(conn.execute(insert), 0.5)
    assert rows_in(postgres_server, table) == []


async def test_bandwidth_cap_slows_a_large_result(postgres_server: str, proxy: FaultProxy) -> None:
    """A 60 kB result through a 100 kB/s cap takes at least 0.6 s."""
    async with await connect(postgres_server, proxy) as conn:
        proxy.set_faults(bandwidth=100_000)
        started = time.monotonic()
        cur = await run_bounded(conn.execute("SELECT repeat('x', 60000)"), 20)
        assert len((await cur.fetchone())[0]) == 60_000
        assert time.monotonic() - started >= 0.6 - SLACK


async def test_the_store_reports_a_blackhole_and_recovers_after_it(
    postgres_server: str, proxy: FaultProxy, schema: str
) -> None:
    """The PostgreSQL store behind the proxy fails an operation within its timeout while
    blackholed, and serves again once the blackhole is cleared: the drill's use."""
    params = conninfo_to_dict(postgres_server)
    user = params.get("user", "postgres")
    url = f"postgresql://{user}@127.0.0.1:{proxy.port}/{params.get('dbname', 'test')}"
    store = PostgresStore(f"{url}?schema={schema}", timeout=1)
    await store.open()
    try:
        (job_id,) = await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="{}")])
        proxy.set_faults(blackhole=True)
        with pytest.raises(StoreUnavailableError):
            await store.job_get(job_id=job_id)
        proxy.clear()
        deadline = time.monotonic() + 20
        while True:  # the pool replaces the connections the blackhole spoiled
            try:
                assert (await store.job_get(job_id=job_id)).id == job_id
                break
            except StoreUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await store.close()
