"""The PostgreSQL store's blocking pool after a checkout interrupted by an exception
that is not an ``Exception`` (``store.py``, ``_retire_sync_pool``).

psycopg_pool leaves the place in its queue of a checkout that a ``KeyboardInterrupt``
interrupted while it waited, and hands that place the next connection given back: a
connection nobody holds and the pool counts out for good. The store retires such a pool;
the next checkout gets a connection from a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

from pg_schema import fresh_store
from tokenline import StoreUnavailableError
from tokenline._jobs import NewJob
from tokenline.stores.postgres import PostgresStore

JOB = NewJob(queue="default", task="t", args="[1]")


@pytest.fixture
async def store(postgres_server: str) -> AsyncIterator[PostgresStore]:
    """An open store on a fresh schema whose blocking pool has one connection, waited
    for 3 s at most; its sessions are named after the schema."""
    query = "&application_name={schema}"
    async with fresh_store(
        postgres_server, "tl_syncpool", query, timeout=3.0, max_connections=1
    ) as s:
        yield s


@contextlib.contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    """Raise KeyboardInterrupt in this (the main) thread ``seconds`` from now, as a
    Ctrl-C does, within the block."""
    assert threading.current_thread() is threading.main_thread()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


async def test_an_enqueue_interrupted_while_it_waits_for_a_connection_loses_none(
    store: PostgresStore,
) -> None:
    """The pool's one connection is out; an enqueue waiting for it is interrupted; the
    connection comes back; the next enqueue gets one at once, not a pool timeout."""
    store.jobs_enqueue_blocking(jobs=[JOB])  # the pool's one connection, made
    pool, held = store._checkout_sync()
    with pytest.raises(KeyboardInterrupt), interrupted_after(0.3):
        store.jobs_enqueue_blocking(jobs=[JOB])  # waits: the one connection is held
    store._checkin_sync(pool, held)
    (second,) = store.jobs_enqueue_blocking(jobs=[JOB])
    again, conn = store._checkout_sync()
    try:
        ids = [r[0] for r in conn.execute(f"SELECT id FROM {store.schema}.jobs ORDER BY id")]
    finally:
        store._checkin_sync(again, conn)
    assert ids[-1] == second
    assert len(ids) == 2  # the interrupted enqueue never reached the server
    assert again is not pool  # the pool it was interrupted in was retired


async def test_a_sync_transaction_interrupted_while_it_waits_for_a_connection_loses_none(
    store: PostgresStore,
) -> None:
    """The same for the pool of sync fenced transactions."""
    pool, held = store._checkout_sync(lent=True)
    with pytest.raises(KeyboardInterrupt), interrupted_after(0.3):
        store._checkout_sync(lent=True)
    store._checkin_sync(pool, held)
    again, conn = store._checkout_sync(lent=True)
    store._checkin_sync(again, conn)
    assert again is not pool


async def test_a_statement_timeout_from_the_url_is_not_reported_as_the_store_timeout(
    postgres_server: str,
) -> None:
    """A URL whose options set a statement_timeout of 1 ms: a statement it cancels is
    reported as canceled, with the server's reason, not as the store's 3 s passing."""
    s = PostgresStore(
        f"{postgres_server}?schema=tl_syncpool_absent&options=-c%20statement_timeout%3D1",
        timeout=3.0,
        migrate=False,
    )
    with (
        psycopg.connect(s.target.conninfo, autocommit=True) as conn,
        pytest.raises(StoreUnavailableError) as raised,
        s._translate(),
    ):
        conn.execute("SELECT pg_sleep(0.5)")
    text = str(raised.value)
    assert "canceled a statement (canceling statement due to statement timeout)" in text
    assert "within" not in text


async def test_enqueues_go_in_after_the_server_ended_the_pools_idle_sessions(
    store: PostgresStore, postgres_server: str
) -> None:
    """Every session of the store ended by the server while idle (as a restart or
    idle_session_timeout ends them): the next blocking and async enqueues take fresh
    connections instead of failing on the ended ones, and each goes in once."""
    store.jobs_enqueue_blocking(jobs=[JOB])
    await store.jobs_enqueue(jobs=[JOB])
    name = store.schema  # the sessions' application_name (the fixture's URL)
    async with await psycopg.AsyncConnection.connect(postgres_server, autocommit=True) as c:
        cur = await c.execute(
            "SELECT array_agg(pid) FROM pg_stat_activity WHERE application_name = %s", (name,)
        )
        (pids,) = await cur.fetchone() or (None,)
    assert pids is not None
    assert len(pids) >= 2  # the blocking pool's, the async pool's, ...
    await _end_sessions(postgres_server, pids)
    (blocking,) = store.jobs_enqueue_blocking(jobs=[JOB])
    (awaited,) = await store.jobs_enqueue(jobs=[JOB])
    pool, conn = store._checkout_sync()
    try:
        ids = [r[0] for r in conn.execute(f"SELECT id FROM {store.schema}.jobs ORDER BY id")]
    finally:
        store._checkin_sync(pool, conn)
    assert len(ids) == 4
    assert ids[2:] == sorted([blocking, awaited])


async def _end_sessions(postgres_server: str, pids: list[int]) -> None:
    """End the sessions ``pids`` from another connection, and wait until they are gone."""
    async with await psycopg.AsyncConnection.connect(postgres_server, autocommit=True) as c:
        await c.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
        for _ in range(600):
            cur = await c.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
            )
            if (await cur.fetchone() or (1,))[0] == 0:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the sessions were not ended")


async def test_fenced_transactions_take_a_live_session_after_the_server_ended_theirs(
    store: PostgresStore, postgres_server: str
) -> None:
    """The pools lent to ``ctx.transaction()`` (sync and async forms): a session the
    server ended while it sat there is replaced before the block gets it."""
    pool, conn = store._checkout_sync(lent=True)
    sync_pid = conn.info.backend_pid
    store._checkin_sync(pool, conn)
    aconn = await store._checkout()
    async_pid = aconn.info.backend_pid
    await store._checkin(aconn)
    await _end_sessions(postgres_server, [sync_pid, async_pid])
    pool, conn = store._checkout_sync(lent=True)
    try:
        assert conn.info.backend_pid != sync_pid
        assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        store._checkin_sync(pool, conn)
    aconn = await store._checkout()
    try:
        assert aconn.info.backend_pid != async_pid
        assert await (await aconn.execute("SELECT 1")).fetchone() == (1,)
    finally:
        await store._checkin(aconn)


async def test_a_checkout_that_meets_a_pool_retired_meanwhile_takes_its_successor(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's interrupt retired the pool between this checkout's look at it
    and its getconn: the checkout takes the new pool, not "the store is closed"."""
    retired = store._require_sync_pool(lent=False)
    store._retire_sync_pool(retired)
    for _ in range(600):
        if retired.closed:
            break
        await asyncio.sleep(0.05)
    assert retired.closed
    require = store._require_sync_pool
    stale = [retired]  # what the racing thread saw

    def seen_first(*, lent: bool) -> Any:
        return stale.pop() if stale else require(lent=lent)

    monkeypatch.setattr(store, "_require_sync_pool", seen_first)
    pool, conn = store._checkout_sync()
    try:
        assert pool is not retired
        assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        store._checkin_sync(pool, conn)
