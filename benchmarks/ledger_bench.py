"""The cost of ``ctx.effect``: no-op jobs per second with and without it.

One in-process worker runs N jobs of a no-op async handler, then N jobs of a handler
that wraps a no-op in ``await ctx.effect_async(key, ...)`` (a key per job: one claim
transaction and one outcome statement each), on a fresh store each time. Figures, not
assertions; the machine's core count is printed with them.

    python benchmarks/ledger_bench.py                       # SQLite in a temp directory
    python benchmarks/ledger_bench.py --url postgresql://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import tempfile
import time
from pathlib import Path

from tokenline import App, JobContext, JobState, Worker, WorkerSettings


def bench_app(url: str) -> App:
    """An app with the two benchmark tasks."""
    app = App(url)

    @app.task(name="bench.plain", queue="bench")
    async def plain(ctx: JobContext, i: int) -> None:
        """Do nothing: the queue's own cost."""

    @app.task(name="bench.effect", queue="bench")
    async def effect(ctx: JobContext, i: int) -> None:
        """Do nothing, once per key, through the ledger."""
        await ctx.effect_async(f"bench:{i}", lambda: i)

    return app


async def measure(url: str, task: str, jobs: int, concurrency: int) -> float:
    """Jobs per second for ``jobs`` jobs of ``task`` on a fresh store at ``url``."""
    app = bench_app(url)
    store = app.open_store()
    await store.open()
    try:
        for start in range(0, jobs, 5000):
            batch = [app.build_job(task, (i,)) for i in range(start, min(jobs, start + 5000))]
            await store.jobs_enqueue(jobs=batch)
        settings = WorkerSettings(
            queues=("bench",), concurrency=concurrency, poll_interval=0.01, rescue_interval=60
        )
        worker = Worker(app, settings)
        started = time.perf_counter()
        runner = asyncio.create_task(worker.run())
        while True:
            (stats,) = await store.queues_stats()
            if stats.count(JobState.SUCCEEDED) >= jobs:
                break
            if runner.done():
                runner.result()
                raise RuntimeError("the worker stopped early")
            await asyncio.sleep(0.02)
        took = time.perf_counter() - started
        worker.request_shutdown()
        await runner
        return jobs / took
    finally:
        await store.close()


def fresh_url(base: str | None) -> tuple[str, str | None]:
    """A store nobody used yet: a new SQLite file, or a new PostgreSQL schema (named)."""
    if base is None:
        path = Path(tempfile.mkdtemp(prefix="tokenline-ledger-bench-")) / "b.db"
        return f"sqlite:///{path}", None
    schema = f"bench_{secrets.token_hex(4)}"
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}schema={schema}", schema


def drop_schema(base: str, schema: str) -> None:
    """Remove a benchmark's PostgreSQL schema."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


async def main() -> None:
    """Parse arguments, run both variants ``--rounds`` times, print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="PostgreSQL base URL [default: SQLite]")
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"bench.plain": [], "bench.effect": []}
    for _ in range(args.rounds):
        for task, rates in results.items():
            url, schema = fresh_url(args.url)
            try:
                rates.append(await measure(url, task, args.jobs, args.concurrency))
            finally:
                if args.url is not None and schema is not None:
                    drop_schema(args.url, schema)
    store = "SQLite" if args.url is None else "PostgreSQL"
    plain = sorted(results["bench.plain"])[len(results["bench.plain"]) // 2]
    effect = sorted(results["bench.effect"])[len(results["bench.effect"]) // 2]
    print(
        f"{store}, {args.jobs} jobs x {args.rounds} rounds, 1 worker x {args.concurrency}, "
        f"{os.cpu_count()} cores (median):"
    )
    print(f"  without ctx.effect: {plain:8,.0f} jobs/s")
    print(f"  with ctx.effect:    {effect:8,.0f} jobs/s  ({effect / plain:.0%} of the plain rate)")
    print(f"  cost per effect:    {1000 / effect - 1000 / plain:8.3f} ms of one worker's time")


if __name__ == "__main__":
    asyncio.run(main())
