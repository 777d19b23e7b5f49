"""Single-call ``app.enqueue`` from several threads of one process, as a threaded web
server calls it: jobs per second for each number of threads.

Each round, on a fresh store (a fresh schema on the PostgreSQL server ``--url`` names,
or a SQLite file in a temporary directory), removed afterwards: ``--threads`` threads
share one App and enqueue one job per call for ``--seconds`` seconds. The thread
counts are interleaved round by round; the medians are printed with each round.

    python benchmarks/enqueue_threads.py [--url postgresql://…] [--threads 1 4 16]
        [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

from _enqueue_app import TASK, enqueue_app

from tokenline.cli.bench import _load


def one_round(url: str | None, threads: int, seconds: float) -> float:
    """Enqueues per second from ``threads`` threads sharing one App."""
    with enqueue_app(url, "tokenline_enqueue_threads") as app:
        counts = [0] * threads
        start = threading.Barrier(threads + 1)
        stop_at: list[float] = []

        def enqueue(n: int) -> None:
            start.wait()
            while time.perf_counter() < stop_at[0]:
                app.enqueue(TASK, n)
                counts[n] += 1

        workers = [threading.Thread(target=enqueue, args=(n,)) for n in range(threads)]
        for w in workers:
            w.start()
        began = time.perf_counter()
        stop_at.append(began + seconds)
        start.wait()
        for w in workers:
            w.join()
        return sum(counts) / (time.perf_counter() - began)


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the rounds interleaved, print each and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a postgresql:// server (default: SQLite)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    load_before = _load()
    store = "PostgreSQL" if args.url else "SQLite"
    rates: dict[int, list[float]] = {n: [] for n in args.threads}
    for _ in range(args.rounds):
        for n in args.threads:
            rates[n].append(one_round(args.url, n, args.seconds))
    for n, got in rates.items():
        each = ", ".join(f"{r:,.0f}" for r in got)
        print(f"{store}, {n} threads: {statistics.median(got):,.0f} enqueues/s (rounds {each})")
    print(f"{os.cpu_count()} cores, load {load_before} before, {_load()} after")


if __name__ == "__main__":
    main()
