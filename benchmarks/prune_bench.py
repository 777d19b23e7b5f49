"""Retention at scale: prune 1,000,000 finished jobs while a worker keeps claiming.

Fills a scratch store with ``--rows`` finished jobs (default 1,000,000; succeeded, ten
days old, one attempt each) in a few big statements, then measures a claim loop in a
separate process — enqueue one job, time ``jobs_claim``, complete it, every
``--period`` seconds — first for ``--baseline`` seconds alone, then while the pruner
(batches of ``--batch`` rows, fenced by the maintenance lease) deletes every filled row.
Prints p50/p99/max claim latency of both phases, the prune's rows per second, the core
count and the load average. Figures, not assertions.

    python benchmarks/prune_bench.py                       # SQLite in a temp directory
    python benchmarks/prune_bench.py --url postgresql://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import sqlite3
import statistics
import time
from multiprocessing.synchronize import Event
from typing import Any

from tokenline._jobs import NewJob
from tokenline.drill._scratch import ScratchStore, scratch_for
from tokenline.maintenance.pruner import Pruner, Retention
from tokenline.stores import store_from_url

DAY = 86_400.0
# Bulk fill, per dialect: the benchmark's own set-up, not tokenline's queries. The
# table names come from the scratch store (quoted identifiers on PostgreSQL).
_SQLITE_JOBS = """
INSERT INTO tokenline_jobs (queue, task, args, priority, run_at, attempt, max_attempts,
    state, lease_token, created_at, updated_at, finished_at)
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
SELECT 'old', 'bench.old', '[]', 0, ?, 1, 5, 'succeeded', 1, ?, ?, ? FROM n
"""
_SQLITE_ATTEMPTS = """
INSERT INTO tokenline_attempts (job_id, token, attempt, owner, started_at, finished_at,
    outcome)
SELECT id, 1, 1, 'bench', finished_at, finished_at, 'succeeded' FROM tokenline_jobs
"""
_POSTGRES_JOBS = """
INSERT INTO {jobs} (queue, task, args, priority, run_at, attempt, max_attempts, state,
    lease_token, created_at, updated_at, finished_at)
SELECT 'old', 'bench.old', '[]', 0, %(t)s, 1, 5, 'succeeded', 1, %(t)s, %(t)s, %(t)s
FROM generate_series(1, %(rows)s)
"""
_POSTGRES_ATTEMPTS = """
INSERT INTO {attempts} (job_id, token, attempt, owner, started_at, finished_at, outcome)
SELECT id, 1, 1, 'bench', finished_at, finished_at, 'succeeded' FROM {jobs}
"""


def fill(scratch: ScratchStore, rows: int, finished_at: float) -> None:
    """``rows`` succeeded jobs, each with its attempt, finished at ``finished_at``."""
    if scratch.placeholder == "?":
        db = scratch.url[len("sqlite:///") :]
        with contextlib.closing(sqlite3.connect(db, timeout=60)) as conn, conn:
            t = finished_at
            conn.execute(_SQLITE_JOBS, (rows, t, t, t, t))
            conn.execute(_SQLITE_ATTEMPTS)
        return
    import psycopg
    from psycopg import sql

    schema = scratch.url.rpartition("schema=")[2]
    names = {
        "jobs": sql.Identifier(schema, "jobs"),
        "attempts": sql.Identifier(schema, "attempts"),
    }
    base = scratch.url.rpartition("schema=")[0].rstrip("?&")
    with psycopg.connect(base, autocommit=True) as conn, conn.transaction():
        conn.execute(sql.SQL(_POSTGRES_JOBS).format(**names), {"t": finished_at, "rows": rows})
        conn.execute(sql.SQL(_POSTGRES_ATTEMPTS).format(**names))
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(names["jobs"]))


def claim_loop(url: str, period: float, stop: Event, out: Any) -> None:
    """A worker's claims, timed, until ``stop``: run in its own process."""

    async def run() -> list[float]:
        store = store_from_url(url)
        await store.open()
        latencies: list[float] = []
        try:
            while not stop.is_set():
                await store.jobs_enqueue(jobs=[NewJob(queue="live", task="bench.live", args="[]")])
                began = time.perf_counter()
                claimed = await store.jobs_claim(owner="bench", queues=["live"], limit=1, ttl=30)
                latencies.append(time.perf_counter() - began)
                for c in claimed:
                    await store.job_complete(lease=c.lease)
                await asyncio.sleep(period)
        finally:
            await store.close()
        return latencies

    out.put(asyncio.run(run()))


def summary(latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (
        f"p50 {statistics.median(ms):7.2f} ms  p99 {p99:7.2f} ms  max {ms[-1]:7.2f} ms  "
        f"({len(ms)} claims)"
    )


async def prune_all(url: str, batch: int) -> tuple[int, float]:
    """Run the pruner once over everything older than a day; rows and seconds."""
    store = store_from_url(url)
    await store.open()
    try:
        lease = await store.resource_lease_acquire(
            resource="tokenline:maintenance", owner="bench-leader", ttl=3600
        )
        assert lease is not None
        pruner = Pruner(store, Retention(DAY, DAY, DAY), batch=batch)
        began = time.perf_counter()
        report = await pruner.run_once(leader=lease)
        took = time.perf_counter() - began
        if report.refused:
            raise RuntimeError("the prune was refused: the leader lost its lease")
        return report.counts["jobs_pruned"], took
    finally:
        await store.close()


def phase(url: str, period: float, seconds: float | None, during: Any = None) -> list[float]:
    """Claim latencies over ``seconds``, or while ``during()`` runs."""
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=claim_loop, args=(url, period, stop, out))
    proc.start()
    try:
        time.sleep(1.0)  # let the child open its store before timing starts
        if during is None:
            time.sleep(seconds or 0)
        else:
            during()
    finally:
        stop.set()
    latencies: list[float] = out.get(timeout=120)
    proc.join(timeout=30)
    return latencies


def main() -> None:
    """Parse arguments, fill, measure both phases, print."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=None, help="postgresql://… (default: SQLite)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="default: %(default)s")
    parser.add_argument("--batch", type=int, default=1000, help="default: %(default)s")
    parser.add_argument("--baseline", type=float, default=15.0, help="seconds (%(default)s)")
    parser.add_argument("--period", type=float, default=0.005, help="seconds (%(default)s)")
    args = parser.parse_args()
    scratch = scratch_for(args.url, prefix="tokenline_prune_bench")
    try:
        scratch.prepare({})

        async def create() -> None:
            store = store_from_url(scratch.url)
            await store.open()
            await store.close()

        asyncio.run(create())
        began = time.perf_counter()
        fill(scratch, args.rows, time.time() - 10 * DAY)
        filled = time.perf_counter() - began
        load_before = " ".join(f"{n:.2f}" for n in os.getloadavg())
        quiet = phase(scratch.url, args.period, args.baseline)
        result: dict[str, tuple[int, float]] = {}

        def prune() -> None:
            result["prune"] = asyncio.run(prune_all(scratch.url, args.batch))

        busy = phase(scratch.url, args.period, None, prune)
        rows, took = result["prune"]
    finally:
        scratch.cleanup()
    store = "SQLite" if args.url is None else "PostgreSQL"
    print(
        f"{store}: {args.rows:,} finished jobs filled in {filled:.1f}s; {os.cpu_count()} "
        f"cores, load average (1/5/15 min) {load_before} before the measurements"
    )
    print(f"  claims alone ({args.baseline:g}s): {summary(quiet)}")
    print(f"  claims during the prune:  {summary(busy)}")
    print(
        f"  prune: {rows:,} jobs (and their attempts) in {took:.1f}s = {rows / took:,.0f} "
        f"rows/s, batches of {args.batch}"
    )


if __name__ == "__main__":
    main()
