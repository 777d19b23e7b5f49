"""``app.enqueue_many`` from plain synchronous code: jobs per second, by kind of batch.

Three kinds, interleaved round by round, each round on a fresh store (a SQLite file in
a temporary directory, or a fresh schema on the PostgreSQL server ``--url`` names),
removed afterwards:

* ``plain``: no keys;
* ``keyed``: an idempotency key per job, not unique;
* ``unique``: ``unique=True``, every key new (each job is inserted).

Each round enqueues ``--jobs`` jobs in batches of ``--batch``, and checks every job is
there once, and that the batches' ids are distinct.

    python benchmarks/enqueue_many_bench.py [--url postgresql://…] [--jobs 20000]
        [--batch 10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from _enqueue_app import TASK, enqueue_app

from tokenline._jobs import JobState
from tokenline.cli.bench import _load

KINDS = ("plain", "keyed", "unique")


def one_round(url: str | None, kind: str, jobs: int, batch: int) -> float:
    """Jobs per second for ``jobs`` jobs of ``kind`` in batches of ``batch``."""
    with enqueue_app(url, "tokenline_enqueue_many") as app:
        batches = [range(start, min(jobs, start + batch)) for start in range(0, jobs, batch)]
        ids: list[int] = []
        t = time.perf_counter()
        for numbers in batches:
            items = [(i,) for i in numbers]
            if kind == "plain":
                ids += app.enqueue_many(TASK, items)
            else:
                keys = [f"key-{i}" for i in numbers]
                ids += app.enqueue_many(TASK, items, keys=keys, unique=kind == "unique")
        rate = jobs / (time.perf_counter() - t)

        async def count(store: Any) -> int:
            return sum(s.count(JobState.QUEUED) for s in await store.queues_stats())

        stored = app.run(count)
    if len(set(ids)) != jobs or stored != jobs + 1:
        raise SystemExit(f"{kind}: {len(set(ids))} distinct ids, {stored - 1} jobs stored")
    return rate


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the rounds interleaved, print each and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a postgresql:// server (default: SQLite)")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    load_before = _load()
    store = "PostgreSQL" if args.url else "SQLite"
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            rates[kind].append(one_round(args.url, kind, args.jobs, args.batch))
    for kind, got in rates.items():
        each = ", ".join(f"{r:,.0f}" for r in got)
        print(
            f"{store}, {kind}: {statistics.median(got):,.0f} jobs/s "
            f"(median; rounds {each}; batches of {args.batch:,})"
        )
    print(f"{os.cpu_count()} cores, load {load_before} before, {_load()} after")


if __name__ == "__main__":
    main()
