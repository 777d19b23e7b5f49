"""A worker on PostgreSQL through a fault proxy: it drains when the database goes
silent or refuses it, and recovers by itself when the database comes back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from tokenline import App, Worker, WorkerSettings, WorkerState
from tokenline.drill import FaultProxy

DEADLINE = 60.0


@pytest.fixture
async def schema(postgres_server: str) -> AsyncIterator[str]:
    """A fresh schema, dropped afterwards."""
    import psycopg

    name = f"tl_rec_{uuid.uuid4().hex[:8]}"
    yield name
    async with await psycopg.AsyncConnection.connect(postgres_server, autocommit=True) as c:
        await c.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def _states(app: App) -> set[str]:
    return {j.state.value for j in app.run(lambda s: s.jobs_list())}


async def _until(what: str, check: Callable[[], object], context: Callable[[], str]) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while asyncio.get_running_loop().time() < deadline:
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}; {context()}")


@pytest.mark.parametrize("fault", ["blackhole", "refuse"])
async def test_worker_drains_on_outage_and_recovers(
    postgres_server: str, schema: str, fault: str
) -> None:
    """During a blackhole (silent server) or refused connections the worker goes
    DRAINING instead of hanging; once the database answers again it returns to READY on
    its own and runs the job enqueued meanwhile."""
    direct = App(f"{postgres_server}?schema={schema}")
    ran: list[int] = []

    async with FaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
        via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        app = App(f"{via}?schema={schema}")

        @app.task(name="mark")
        async def mark(ctx: object, n: int) -> None:
            """Record that job ``n`` ran."""
            ran.append(n)

        direct.task(name="mark")(mark)
        await asyncio.to_thread(direct.enqueue, "mark", 1)
        worker = Worker(
            app,
            WorkerSettings(
                concurrency=2, lease_ttl=3, renew_interval=0.5, poll_interval=0.1,
                rescue_interval=0.5, store_timeout=0.5,
            ),
        )  # fmt: skip
        states: list[WorkerState] = []
        worker.on_state_change = lambda old, new, why: states.append(new)
        run = asyncio.create_task(worker.run())

        def why() -> str:
            return f"worker {worker.state.value}, states {[s.value for s in states]}, ran {ran}"

        try:
            await _until("the first job to commit", lambda: _states(direct) == {"succeeded"}, why)
            proxy.set_faults(**{fault: True})
            proxy.reset()  # cut what is open; what comes next meets the fault
            await _until("draining", lambda: WorkerState.DRAINING in states, why)
            await asyncio.to_thread(direct.enqueue, "mark", 2)
            await asyncio.sleep(1.5)  # the outage lasts a few renewal periods
            assert 2 not in ran
            proxy.clear()
            proxy.reset()  # blackholed connections are out of step: start afresh
            await _until("the job enqueued during the outage", lambda: 2 in ran, why)
            assert worker.state in (WorkerState.READY, WorkerState.PROCESSING)
            after = states[states.index(WorkerState.DRAINING) :]
            assert WorkerState.READY in after
            await _until("both jobs to commit", lambda: _states(direct) == {"succeeded"}, why)
            assert ran.count(1) == 1
        finally:
            worker.request_shutdown()
            worker.request_shutdown()
            await asyncio.wait_for(run, DEADLINE)
            await asyncio.to_thread(direct.close)
            proxy.clear()  # nothing held back while the proxy closes
