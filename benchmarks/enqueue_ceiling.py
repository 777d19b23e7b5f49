"""A single enqueue on PostgreSQL against its ceiling on the same server.

``app.enqueue`` from plain synchronous code, one job per call, against a bare
``INSERT … RETURNING id`` of a similar row into a plain table, committed one at a time
from one psycopg connection: the least a durable single enqueue can cost there.
Interleaved, round by round, each on a fresh schema or table removed afterwards.

    python benchmarks/enqueue_ceiling.py [--url postgresql://…] [--calls 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import secrets
import time

import psycopg
from _enqueue_app import TASK, enqueue_app
from _report import POSTGRES_URL, load, print_machine, print_medians


def app_round(url: str, calls: int) -> float:
    """Single-call enqueues per second through tokenline, on a fresh schema."""
    with enqueue_app(url, "tokenline_ceiling") as app:
        t = time.perf_counter()
        for i in range(calls):
            app.enqueue(TASK, i)
        return calls / (time.perf_counter() - t)


def raw_round(url: str, calls: int) -> float:
    """Bare committed INSERTs per second of a similar row, on a fresh table."""
    table = f"tokenline_ceiling_{secrets.token_hex(4)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (id bigserial PRIMARY KEY, queue text, task text, "  # type: ignore[arg-type]
            "args text, priority integer, run_at double precision, state text, "
            "created_at double precision)"
        )
        try:
            insert = (
                f"INSERT INTO {table} (queue, task, args, priority, run_at, state, created_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id"
            )
            t = time.perf_counter()
            for i in range(calls):
                conn.execute(insert, ("default", "ceiling.noop", f"[{i}]", 0, 0.0, "queued", 0.0))  # type: ignore[arg-type]
            return calls / (time.perf_counter() - t)
        finally:
            conn.execute(f"DROP TABLE {table}")  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the rounds interleaved, print each and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=POSTGRES_URL, help="the postgresql:// server")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    load_before = load()
    rates: dict[str, list[float]] = {"app.enqueue": [], "bare INSERT": []}
    for _ in range(args.rounds):
        rates["app.enqueue"].append(app_round(args.url, args.calls))
        rates["bare INSERT"].append(raw_round(args.url, args.calls))
    print_medians(rates, lambda rate: f"{rate:,.0f}/s")
    print_machine(load_before)


if __name__ == "__main__":
    main()
