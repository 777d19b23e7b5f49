"""The blocking paths of the PostgreSQL store, timed from one thread.

A sync handler's fenced transaction (``with store.fenced_transaction(...)``, one
``SELECT 1`` in the block, the job completed by its commit) and a blocking enqueue
(``jobs_enqueue_blocking``, what ``app.enqueue`` from a thread runs), each ``--calls``
times in a row on a fresh schema removed afterwards; microseconds per call, each round
printed, then the medians. Both run under the deadline of ``_cutoff.py``; this is what
they cost with it.

    python benchmarks/sync_paths_bench.py [--url postgresql://…] [--calls 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import psycopg
from _report import POSTGRES_URL, load, print_machine, print_medians

from tokenline._jobs import NewJob
from tokenline.stores.postgres import PostgresStore


async def one_round(url: str, calls: int) -> tuple[float, float]:
    """Microseconds per sync transaction and per blocking enqueue, on a fresh schema."""
    schema = f"tokenline_syncpaths_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(f"{url}?schema={schema}", timeout=10)
    await store.open()
    try:
        job = NewJob(queue="default", task="t", args="[]")
        await store.jobs_enqueue(jobs=[job] * calls)
        claimed = await store.jobs_claim(owner="w", queues=["default"], limit=calls, ttl=600)

        def transactions() -> float:
            started = time.perf_counter()
            for c in claimed:
                with store.fenced_transaction(lease=c.lease, timeout=300) as conn:
                    conn.execute("SELECT 1")
            return (time.perf_counter() - started) / len(claimed) * 1e6

        def enqueues() -> float:
            started = time.perf_counter()
            for _ in range(calls):
                store.jobs_enqueue_blocking(jobs=[job])
            return (time.perf_counter() - started) / calls * 1e6

        return await asyncio.to_thread(transactions), await asyncio.to_thread(enqueues)
    finally:
        await store.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the rounds, print each and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=POSTGRES_URL, help="the postgresql:// server")
    p.add_argument("--calls", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    load_before = load()
    rounds = [asyncio.run(one_round(args.url, args.calls)) for _ in range(args.rounds)]
    timed = {
        "sync transaction": [r[0] for r in rounds],
        "blocking enqueue": [r[1] for r in rounds],
    }
    print_medians(timed, lambda us: f"{us:,.0f} µs")
    print_machine(load_before)


if __name__ == "__main__":
    main()
