"""What one claim costs under backlogs that have made claims slow before.

Each case runs on a fresh store (a SQLite file in a temporary directory, or a fresh
schema on the PostgreSQL server ``--url`` names), removed afterwards. One process claims
``--size`` jobs and finishes them, again and again, and the median time of a claim is
reported:

* ``runnable``: ``--backlog`` runnable jobs, enqueued at once, the table never analyzed
  (on PostgreSQL, a burst its statistics miss);
* ``later``: ``--later`` jobs of priority 5 delayed an hour (as a retry storm of
  high-priority jobs leaves them) above 5,000 runnable jobs of priority 0;
* ``due``: as ``later``, with one more job of priority 5 runnable before each claim
  (retries coming due), which the claim takes before reading on below the delayed ones;
* ``baseline``: the 5,000 runnable jobs alone;
* ``spread``: 5,000 runnable jobs, each of a priority of its own (the most priorities a
  claim can read from).

    python benchmarks/claim_bench.py [--url postgresql://…] [--backlog 40000]
        [--later 100000] [--claims 40] [--size 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from tokenline import App
from tokenline._jobs import Finish, NewJob, Outcome
from tokenline.cli.bench import _load
from tokenline.drill._scratch import scratch_for

QUEUE = "claims"
BATCH = 10_000


def _jobs(n: int, **kw: Any) -> list[list[NewJob]]:
    return [
        [NewJob(QUEUE, "bench.noop", "[]", **kw) for _ in range(min(BATCH, n - start))]
        for start in range(0, n, BATCH)
    ]


def _spread(n: int) -> list[list[NewJob]]:
    return [
        [NewJob(QUEUE, "bench.noop", "[]", priority=p) for p in range(start, min(n, start + BATCH))]
        for start in range(0, n, BATCH)
    ]


def case(
    url: str | None, batches: list[list[NewJob]], claims: int, size: int, *, due: bool = False
) -> float:
    """Median seconds of one claim of ``size`` jobs on a fresh store holding ``batches``;
    ``due``: with a job of priority 5 enqueued, runnable, before each claim (not timed)."""
    scratch = scratch_for(url, keep=False, prefix="tokenline_claims")
    try:
        scratch.prepare({})
        app = App(scratch.url)

        async def run(store: Any) -> list[float]:
            for batch in batches:
                await store.jobs_enqueue(jobs=batch)
            took = []
            for _ in range(claims):
                if due:
                    await store.jobs_enqueue(jobs=[NewJob(QUEUE, "bench.noop", "[]", priority=5)])
                t = time.perf_counter()
                got = await store.jobs_claim(owner="bench", queues=[QUEUE], limit=size, ttl=60)
                took.append(time.perf_counter() - t)
                if len(got) < size:
                    raise SystemExit(f"a claim took {len(got)} of {size} jobs: backlog too small")
                await store.jobs_finish(finishes=[Finish(c.lease, Outcome.SUCCEEDED) for c in got])
            return took

        try:
            return statistics.median(app.run(run))
        finally:
            app.close()
    finally:
        scratch.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run each case, print the medians with the machine's load."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a postgresql:// server (default: SQLite)")
    p.add_argument("--backlog", type=int, default=40_000)
    p.add_argument("--later", type=int, default=100_000)
    p.add_argument("--claims", type=int, default=40)
    p.add_argument("--size", type=int, default=50)
    args = p.parse_args(argv)
    load_before = _load()
    store = "PostgreSQL" if args.url else "SQLite"
    runnable = 5_000
    later = _jobs(args.later, priority=5, delay=3600.0) + _jobs(runnable)
    cases = {
        f"runnable: {args.backlog:,} runnable jobs, never analyzed": (_jobs(args.backlog), False),
        f"later: {args.later:,} delayed jobs of priority 5 above {runnable:,} runnable": (
            later,
            False,
        ),
        "due: as later, with a job of priority 5 runnable before each claim": (later, True),
        f"baseline: {runnable:,} runnable jobs alone": (_jobs(runnable), False),
        f"spread: {runnable:,} runnable jobs, each of a priority of its own": (
            _spread(runnable),
            False,
        ),
    }
    for name, (batches, due) in cases.items():
        took = case(args.url, batches, args.claims, args.size, due=due)
        print(f"{store}, {name}: a claim of {args.size} takes {took * 1000:.2f} ms (median)")
    print(f"{os.cpu_count()} cores, load {load_before} before, {_load()} after")


if __name__ == "__main__":
    main()
