"""A ledger write (``ctx.effect``, ``ctx.fenced``) or a resource lease (``ctx.lease``)
from inside the job's own open ``ctx.transaction()``, on every store with transactions.

Where the write needs what the transaction holds (SQLite's only write lock, the split
ledger's job fence row) it used to wait for the store's timeout, fail as a coordination
error that spends no attempt, and do the same on every delivery: a job that never ended.
Those stores refuse it at once, as a permanent error naming the call; the others run it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenline import App, JobContext, Worker, WorkerSettings
from tokenline._jobs import Job, JobState
from tokenline.stores import split_url

DEADLINE = 60.0
SETTINGS = WorkerSettings(
    queues=("tx",), lease_ttl=3, renew_interval=0.5, poll_interval=0.05, concurrency=1
)


def _postgres(server: str, prefix: str) -> Iterator[str]:
    import psycopg

    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    yield f"{server}?schema={schema}&options=-c%20search_path%3D{schema}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture(params=["memory", "sqlite", "postgres", "split"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store of each kind that has ``ctx.transaction()`` and a ledger."""
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tx.db'}"
    elif request.param == "postgres":
        yield from _postgres(request.getfixturevalue("postgres_server"), "tl_ltx")
    else:
        redis: str = request.getfixturevalue("redis_url")
        for ledger in _postgres(request.getfixturevalue("postgres_server"), "tl_ltxs"):
            yield split_url(broker=redis, ledger=ledger)


@pytest.mark.parametrize("call", ["effect", "fenced", "lease"])
async def test_a_ledger_call_inside_the_jobs_transaction_runs_or_is_refused(
    url: str, call: str
) -> None:
    """Refused at once (dead after one attempt, the error naming the call) where it
    would wait for its own transaction; done where the store can (the job succeeds)."""
    app = App(url)
    calls: list[int] = []

    @app.task(name="t.inside", queue="tx", max_attempts=3)
    def inside(ctx: JobContext) -> None:
        with ctx.transaction():
            if call == "effect":
                ctx.effect("mail:1", calls.append, ctx.token)
            elif call == "fenced":
                ctx.fenced("invoice:1")
            else:
                with ctx.lease("account:1") as held:
                    calls.append(held.token)

    # A store timeout far below the deadline: a write waiting for its own transaction
    # runs into it long before the test gives up.
    store = app.open_store(timeout=2.0)
    await store.open()
    caps = store.capabilities
    if call == "lease":
        refuses = caps.lease_waits_for_transaction
        assert refuses == url.startswith("sqlite:"), "the capability moved"
    else:
        refuses = caps.ledger_waits_for_transaction
        assert refuses == url.startswith(("sqlite:", "split:")), "the capability moved"
    worker = Worker(app, SETTINGS, store=store)
    run = asyncio.create_task(worker.run())
    try:
        jid = await app.enqueue_async("t.inside", store=store)

        async def finished() -> Job:
            while not (job := await store.job_get(job_id=jid)).state.finished:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            return job

        job = await asyncio.wait_for(finished(), DEADLINE)
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(run, DEADLINE)
        await store.close()
        app.close()
    if refuses:
        assert (job.state, job.attempt) == (JobState.DEAD, 1), job
        assert f"ctx.{call} inside ctx.transaction()" in (job.last_error or ""), job
        assert calls == []
    else:
        assert (job.state, job.attempt) == (JobState.SUCCEEDED, 1), job
        assert len(calls) == (0 if call == "fenced" else 1), calls


@pytest.mark.parametrize("form", ["sync", "async"])
async def test_a_handler_that_raises_after_its_transaction_committed_has_succeeded(
    url: str, form: str
) -> None:
    """The transaction committed the handler's writes with the job's completion, so an
    error raised after it is logged, not recorded: the job has succeeded. On the split
    topology the ledger held the completion while Redis still had the job running, and
    the error was recorded as the attempt's failure: dead with one attempt, or run
    again."""
    app = App(url)
    runs: list[int] = []

    @app.task(name="t.sync_then_raise", queue="tx", max_attempts=1)
    def sync_then_raise(ctx: JobContext) -> None:
        runs.append(ctx.token)
        with ctx.transaction():
            pass
        raise RuntimeError("after the commit")

    @app.task(name="t.async_then_raise", queue="tx", max_attempts=1)
    async def async_then_raise(ctx: JobContext) -> None:
        runs.append(ctx.token)
        async with ctx.transaction():
            pass
        raise RuntimeError("after the commit")

    store = app.open_store(timeout=2.0)
    await store.open()
    worker = Worker(app, SETTINGS, store=store)
    run = asyncio.create_task(worker.run())
    try:
        jid = await app.enqueue_async(f"t.{form}_then_raise", store=store)

        async def finished() -> Job:
            while not (job := await store.job_get(job_id=jid)).state.finished:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            return job

        job = await asyncio.wait_for(finished(), DEADLINE)
        attempts = await store.job_attempts(job_id=jid)
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(run, DEADLINE)
        await store.close()
        app.close()
    assert job.state is JobState.SUCCEEDED, job
    assert [a.outcome for a in attempts] == ["succeeded"], attempts
    assert len(runs) == 1
    assert worker.counters.dead == 0
