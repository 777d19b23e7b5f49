"""A blocking PostgreSQL connection whose server goes silent behind a proxy is cut at
its deadline, never waited on for ever (``stores/postgres/_cutoff.py``).

The proxy acknowledges every packet, as a load balancer or a pooler in front of the
server does, so neither ``statement_timeout`` (the server never sees the statement)
nor keepalives end the wait. Each call below runs in a thread of its own: a thread
still blocked long after the deadline fails the test rather than hanging it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tokenline import StoreUnavailableError
from tokenline._jobs import NewJob
from tokenline.drill import FaultProxy
from tokenline.stores.postgres import PostgresStore

#: The store timeout of these stores: their deadline is 2 x 1 + 1 = 3 s.
TIMEOUT = 1.0
#: How long a call may take before the test calls it hung: far above the deadline.
HUNG = 60.0


@pytest.fixture
async def proxied(postgres_server: str) -> AsyncIterator[tuple[PostgresStore, FaultProxy]]:
    """An open store on a fresh schema, reached through a fault proxy."""
    import psycopg

    schema = f"tl_cut_{uuid.uuid4().hex[:8]}"
    async with FaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
        via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        store = PostgresStore(f"{via}?schema={schema}", timeout=TIMEOUT)
        await store.open()
        try:
            yield store, proxy
        finally:
            proxy.clear()
            await store.close()
    async with await psycopg.AsyncConnection.connect(postgres_server, autocommit=True) as c:
        await c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def in_thread(call: Callable[[], Any]) -> BaseException | None:
    """Run ``call`` in a thread; the error it raised (None if it returned)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    await asyncio.to_thread(thread.join, HUNG)
    assert not thread.is_alive(), "the call still waits on a silent server"
    return outcome[0]


async def test_a_blocking_enqueue_to_a_silent_server_fails_at_its_deadline(
    proxied: tuple[PostgresStore, FaultProxy],
) -> None:
    """app.enqueue from a web server's thread: a coordination error, not a hang; the
    store works again once the server answers."""
    store, proxy = proxied
    job = NewJob(queue="default", task="t", args="[1]")
    assert await in_thread(lambda: store.jobs_enqueue_blocking(jobs=[job])) is None
    proxy.set_faults(blackhole=True)
    failed = await in_thread(lambda: store.jobs_enqueue_blocking(jobs=[job]))
    assert isinstance(failed, StoreUnavailableError), failed
    assert store._cutoffs.cut >= 1
    proxy.clear()
    assert await in_thread(lambda: store.jobs_enqueue_blocking(jobs=[job])) is None


@pytest.mark.parametrize("when", ["opening", "in the block"])
async def test_a_sync_transaction_on_a_silent_server_fails_at_its_deadline(
    proxied: tuple[PostgresStore, FaultProxy], when: str
) -> None:
    """A sync handler's ctx.transaction(): its BEGIN (or a statement of the block)
    on a silent server used to hold the handler's thread for ever, and with it a slot
    of the worker. The opening is cut at the store's deadline, the block at the
    transaction's own timeout (the attempt's remaining time)."""
    import psycopg

    store, proxy = proxied
    await store.jobs_enqueue(
        jobs=[NewJob(queue="default", task="t", args=f"[{n}]") for n in (1, 2)]
    )
    first, second = await store.jobs_claim(owner="w", queues=["default"], limit=2, ttl=60)

    def transaction(lease: Any, *, cut: bool) -> None:
        with store.fenced_transaction(lease=lease, timeout=2.0) as conn:
            if cut:
                proxy_faults(blackhole=True)
            conn.execute("SELECT 1")

    loop = asyncio.get_running_loop()

    def proxy_faults(**faults: Any) -> None:
        asyncio.run_coroutine_threadsafe(_set(proxy, faults), loop).result(10)

    # The pool's connection exists already: the wait is on a statement, not a connect.
    assert await in_thread(lambda: transaction(first.lease, cut=False)) is None
    if when == "opening":
        proxy.set_faults(blackhole=True)
        failed = await in_thread(lambda: transaction(second.lease, cut=False))
        assert isinstance(failed, StoreUnavailableError), failed
    else:
        # Your own statement in the block: the driver's error, as for any lost connection.
        failed = await in_thread(lambda: transaction(second.lease, cut=True))
        assert isinstance(failed, psycopg.OperationalError | StoreUnavailableError), failed
    assert store._cutoffs.cut >= 1


async def _set(proxy: FaultProxy, faults: dict[str, Any]) -> None:
    proxy.set_faults(**faults)


async def test_threads_opening_an_app_on_a_silent_server_share_one_wait(
    postgres_server: str,
) -> None:
    """The first enqueues of a fresh App, from several threads at once, against a
    server that does not answer: each waited for the open before it to fail, then
    tried its own, so the n-th thread waited n connection timeouts. They now share the
    one open and its error: one connection tried, every thread told."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenline import App

    threads = 4
    async with FaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
        proxy.set_faults(blackhole=True)
        via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        app = App(f"{via}?schema=tl_cut_never_{uuid.uuid4().hex[:8]}&connect_timeout=2")
        app.task(name="t")(lambda ctx: None)
        start = threading.Barrier(threads, timeout=30)

        def first_enqueue(_: int) -> BaseException | None:
            start.wait()
            try:
                app.enqueue("t")
            except BaseException as exc:
                return exc
            return None

        def all_threads() -> list[BaseException | None]:
            with ThreadPoolExecutor(threads) as pool:
                return list(pool.map(first_enqueue, range(threads)))

        try:
            errors = await asyncio.wait_for(asyncio.to_thread(all_threads), HUNG)
        finally:
            await asyncio.to_thread(app.close)
        assert all(isinstance(e, StoreUnavailableError) for e in errors), errors
        assert proxy.stats.accepted == 1, proxy.stats


def test_a_connection_found_past_its_deadline_on_a_late_wake_is_given_grace() -> None:
    """After a SIGSTOP the watcher woke past every deadline and cut each connection at
    once, though its answer might be in its socket, and logged that the server had
    stopped answering. Woken late, it now gives them a grace period (once): one that
    is done meanwhile is not cut; one still waiting after it is."""
    import socket
    import time

    from tokenline.stores.postgres._cutoff import GRACE, Cutoffs

    cutoffs = Cutoffs("test")
    answered, answered_peer = socket.socketpair()
    stuck, stuck_peer = socket.socketpair()
    with answered, answered_peer, stuck, stuck_peer:
        # Deadlines 5 s in the past: what the watcher sees after a 5 s pause.
        on_time = cutoffs.arm(answered, -5.0)
        cutoffs.arm(stuck, -5.0)
        time.sleep(GRACE / 4)
        assert cutoffs.cut == 0  # the late wake cut nothing
        on_time.__exit__(None, None, None)  # its answer came: disarmed within the grace
        deadline = time.monotonic() + HUNG
        while cutoffs.cut == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cutoffs.cut == 1  # the one still waiting, after its grace
        answered_peer.sendall(b"x")
        assert answered.recv(1) == b"x"  # the connection that was done still works
