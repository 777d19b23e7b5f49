"""The cost of ``ctx.effect`` and ``ctx.transaction``: no-op jobs per second with and
without them.

One in-process worker (concurrency 50 by default) runs ``--jobs`` jobs (default 5,000)
of a no-op async handler, then as many of a handler that wraps a no-op in
``await ctx.effect_async(key, ...)`` (a key per job: one claim transaction and one
outcome statement each), then as many whose handler runs ``SELECT 1`` in
``async with ctx.transaction()`` (the job completed by the transaction's commit),
``--rounds`` times (default 3), interleaved; the medians are printed. Each measurement
runs on a scratch store of its own: a SQLite file in a fresh temporary directory, or a
fresh schema on the PostgreSQL server ``--url`` names, removed right after it. Figures,
not assertions; the machine's core count and load average are printed with them.

    python benchmarks/ledger_bench.py                       # SQLite in a temp directory
    python benchmarks/ledger_bench.py --url postgresql://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import time

from tokenline import App, JobContext, JobState, Worker, WorkerSettings
from tokenline.drill._scratch import scratch_for


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

    @app.task(name="bench.transaction", queue="bench")
    async def transaction(ctx: JobContext, i: int) -> None:
        """One statement in a fenced transaction, which completes the job."""
        async with ctx.transaction() as conn:
            result = conn.execute("SELECT 1")  # sqlite3's is sync, psycopg's async
            if inspect.isawaitable(result):
                await result

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


async def main() -> None:
    """Parse arguments, run both variants ``--rounds`` times, print the medians."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url",
        default=None,
        help="postgresql://… (a fresh schema per measurement, dropped after it); "
        "default: a SQLite file in a temporary directory, removed after it",
    )
    parser.add_argument(
        "--jobs", type=int, default=5000, help="jobs per measurement (default: %(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=50,
        help="the worker's concurrency (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="measurements of each handler (default: %(default)s)"
    )
    args = parser.parse_args()
    load_before = " ".join(f"{n:.2f}" for n in os.getloadavg())
    results: dict[str, list[float]] = {
        "bench.plain": [],
        "bench.effect": [],
        "bench.transaction": [],
    }
    for _ in range(args.rounds):
        for task, rates in results.items():
            scratch = scratch_for(args.url, prefix="tokenline_ledger_bench")
            try:
                scratch.prepare({})
                rates.append(await measure(scratch.url, task, args.jobs, args.concurrency))
            finally:
                scratch.cleanup()
    store = "SQLite" if args.url is None else "PostgreSQL"
    plain, effect, transaction = (
        sorted(rates)[len(rates) // 2]
        for rates in (results["bench.plain"], results["bench.effect"], results["bench.transaction"])
    )
    print(
        f"{store}, {args.jobs} jobs x {args.rounds} rounds, 1 worker x {args.concurrency}, "
        f"{os.cpu_count()} cores, load average (1/5/15 min) {load_before} before the run "
        "(median):"
    )
    print(f"  without ctx.effect: {plain:8,.0f} jobs/s")
    print(f"  with ctx.effect:    {effect:8,.0f} jobs/s  ({effect / plain:.0%} of the plain rate)")
    print(f"  cost per effect:    {1000 / effect - 1000 / plain:8.3f} ms of one worker's time")
    print(
        f"  with ctx.transaction: {transaction:6,.0f} jobs/s  "
        f"({transaction / plain:.0%} of the plain rate; "
        f"{1000 / transaction - 1000 / plain:.3f} ms per transaction)"
    )


if __name__ == "__main__":
    asyncio.run(main())
