"""Many async handlers in ``async with ctx.transaction()`` at once, on SQLite.

Each waiting begin took a thread of the event loop's default pool (min(32, cores + 4)
threads) to wait for the file's write lock, and the block holding the lock needed one
of those threads to commit: with more blocks than threads, every thread waited for a
commit that could not run, and the worker stood still until the lock waits ran out (as
long as each attempt may run). Now the async blocks of a store queue on the event loop,
one at a time, as SQLite would have them write anyway.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from tokenline import App, JobContext, JobState, Worker, WorkerSettings

#: Generous: this test must pass on a slow, noisy machine. Without the fix it waited
#: for the attempts' lock waits, the job timeout (far longer).
DEADLINE = 60.0

#: More blocks at once than the default pool has threads on any machine (at most 32).
CONCURRENCY = 40


async def test_more_async_blocks_than_pool_threads_all_commit(tmp_path: Path) -> None:
    path = tmp_path / "many.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE marks (n integer)")
    app = App(f"sqlite:///{path}")

    @app.task(name="mark")
    async def mark(ctx: JobContext, n: int) -> None:
        async with ctx.transaction() as conn:
            conn.execute("INSERT INTO marks (n) VALUES (?)", (n,))
            await asyncio.sleep(0.01)  # the others pile up behind the lock meanwhile

    jobs = 2 * CONCURRENCY
    store = app.open_store()
    await store.open()
    await store.jobs_enqueue(jobs=[app.build_job("mark", (n,)) for n in range(jobs)])
    worker = Worker(app, WorkerSettings(concurrency=CONCURRENCY, poll_interval=0.05), store=store)
    run = asyncio.create_task(worker.run())
    try:

        async def all_done() -> None:
            while True:
                stats = await store.queues_stats()
                if sum(s.count(JobState.SUCCEEDED) for s in stats) == jobs:
                    return
                await asyncio.sleep(0.05)

        await asyncio.wait_for(all_done(), DEADLINE)
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(run, DEADLINE)
        app.close()
    with sqlite3.connect(path) as conn:
        marks = sorted(n for (n,) in conn.execute("SELECT n FROM marks"))
    assert marks == list(range(jobs))
