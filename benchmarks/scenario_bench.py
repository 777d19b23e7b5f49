"""The scenario users know: single-call enqueue, then one job at a time per worker.

``N`` jobs are enqueued one ``app.enqueue`` call at a time from plain synchronous code
(timed: single-call enqueues per second); then ``--workers`` worker processes, each
running ``--concurrency`` jobs at a time (1 by default), process them, every job doing
one autocommit ``INSERT`` into a table on PostgreSQL (timed from the resumed queue, so
the workers' start-up is excluded: jobs per second). Afterwards the sink table must
hold every job exactly once; the run fails otherwise.

The store is a scratch store (a SQLite file in a temporary directory, or a fresh schema
on the server ``--url`` names), removed afterwards; the sink table lives on ``--sink``
(default: ``TOKENLINE_TEST_POSTGRES_URL`` or the local test database) and is dropped
afterwards. Prints one JSON line per round (for scripts comparing variants) and a summary
with the machine's core count and load average.

    python benchmarks/scenario_bench.py [--url postgresql://…] [--jobs 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tokenline import App
from tokenline.cli.bench import _cpu_seconds, wait_for_all
from tokenline.drill._scratch import scratch_for

QUEUE = "scenario"
SINK_ENV = "TOKENLINE_SCENARIO_SINK"
TABLE_ENV = "TOKENLINE_SCENARIO_TABLE"
DEFAULT_SINK = os.environ.get(
    "TOKENLINE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def scenario_app(url: str | None) -> App:
    """The app with the scenario's task: one autocommit INSERT per job."""
    app = App(url)
    state: dict[str, Any] = {}

    @app.task(name="scenario.insert", queue=QUEUE)
    async def insert(ctx: object, i: int) -> None:
        """Insert one row into the sink table on its own autocommit connection."""
        import psycopg

        conn = state.get("conn")
        if conn is None or conn.closed:
            conn = await psycopg.AsyncConnection.connect(os.environ[SINK_ENV], autocommit=True)
            state["conn"] = conn
        table = os.environ[TABLE_ENV]
        await conn.execute(f"INSERT INTO {table} (i) VALUES (%s)", (i,))  # type: ignore[arg-type]

    return app


#: The workers' app: the runner hands them the scratch store in TOKENLINE_URL.
app = scenario_app(None) if os.environ.get("TOKENLINE_URL") else None


def load_average() -> str:
    """The load average (1, 5 and 15 min), for the summary line."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summary(label: str, rounds: list[dict[str, Any]], load_before: str) -> str:
    """One line of medians over ``rounds``, with the machine's cores and load."""
    return (
        f"{label}: single-call enqueue "
        f"{statistics.median(r['enqueue_per_s'] for r in rounds):,.0f}/s, processed "
        f"{statistics.median(r['processed_per_s'] for r in rounds):,.0f}/s "
        f"(median of {len(rounds)}); {os.cpu_count()} cores, load {load_before} before, "
        f"{load_average()} after"
    )


def _machine_busy() -> tuple[float, float]:
    """Busy and total CPU ticks of the whole machine so far (Linux's /proc/stat)."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return sum(ticks) - idle, sum(ticks)


def one_round(
    url: str | None,
    sink: str,
    jobs: int,
    workers: int,
    concurrency: int,
    prefetch: str = "auto",
) -> dict[str, Any]:
    """Run the scenario once on a fresh store; return its figures."""
    import psycopg

    scratch = scratch_for(url, keep=False, prefix="tokenline_scenario")
    table = f"tokenline_scenario_sink_{secrets.token_hex(4)}"
    with psycopg.connect(sink, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (i integer NOT NULL)")  # type: ignore[arg-type]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        scratch.prepare({})
        a = scenario_app(scratch.url)
        a.run(lambda s: s.queue_pause(queue=QUEUE))  # opens the store: not timed
        t = time.perf_counter()
        last = 0
        for i in range(jobs):
            last = a.enqueue("scenario.insert", i)
        enqueue_s = time.perf_counter() - t
        env = {
            **os.environ,
            "TOKENLINE_URL": scratch.url,
            SINK_ENV: sink,
            TABLE_ENV: table,
            # Ahead of the caller's own path, not instead of it: a run against another
            # checkout (PYTHONPATH=…/src) must have its workers run that code too.
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p
            ),
        }
        cmd = [
            sys.executable, "-m", "tokenline", "worker", "--app", "scenario_bench:app",
            "--queues", QUEUE, "--concurrency", str(concurrency), "--poll-interval", "0.05",
            "--prefetch", prefetch, "--log-level", "warning",
        ]  # fmt: skip
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL) for _ in range(workers)]
        deadline = time.monotonic() + 60
        while sum(w.state == "ready" for w in a.run(lambda s: s.workers_list())) < workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("the workers did not start")
            time.sleep(0.05)
        cpu_before, busy_before = _cpu_seconds(procs), _machine_busy()
        t = time.perf_counter()
        a.run(lambda s: s.queue_resume(queue=QUEUE))
        # Through the app's open store: a connection per look (as the scratch store's
        # helpers open) cost the server more CPU than the jobs' INSERTs did.
        process_s = wait_for_all(a, jobs, last, procs, t)
        cpu_after, busy_after = _cpu_seconds(procs), _machine_busy()
        with psycopg.connect(sink, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT count(*), count(DISTINCT i) FROM {table}"  # type: ignore[arg-type]
            ).fetchone()
        assert row is not None
        if row[0] != jobs or row[1] != jobs:
            raise SystemExit(f"sink holds {row[0]} rows, {row[1]} distinct; expected {jobs}")
        a.close()
        return {
            "store": "postgres" if scratch.url.startswith("postgres") else "sqlite",
            "jobs": jobs,
            "workers": workers,
            "concurrency": concurrency,
            "prefetch": prefetch,
            "enqueue_per_s": round(jobs / enqueue_s),
            "processed_per_s": round(jobs / process_s),
            # Both workers' CPU (all threads) per job, and how busy the machine's cores
            # were meanwhile (workers, servers and this process): is the run CPU-bound?
            "worker_cpu_us_per_job": (
                round((cpu_after - cpu_before) / jobs * 1e6)
                if cpu_before is not None and cpu_after is not None
                else None
            ),
            "machine_busy": round(
                (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1]), 2
            ),
        }
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
        with psycopg.connect(sink, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")  # type: ignore[arg-type]
        scratch.cleanup()


def _prefetch(text: str) -> str:
    """A ``--prefetch`` value: ``auto`` or a whole number, as the worker takes it."""
    if text != "auto" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a whole number")
    return text


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the rounds, print each round and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a postgresql:// server (default: SQLite)")
    p.add_argument("--sink", default=DEFAULT_SINK, help="PostgreSQL for the jobs' INSERTs")
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--prefetch",
        type=_prefetch,
        nargs="+",
        default=["auto"],
        help="the workers' prefetch (auto, the default, or a number); several values are "
        "run interleaved, round by round",
    )
    args = p.parse_args(argv)
    load_before = load_average()
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in args.prefetch}
    for _ in range(args.rounds):
        for n in args.prefetch:
            r = one_round(args.url, args.sink, args.jobs, args.workers, args.concurrency, n)
            print(json.dumps(r), flush=True)
            results[n].append(r)
    for n, rounds in results.items():
        label = (
            f"{rounds[0]['store']}: {args.jobs} jobs, {args.workers} workers x "
            f"{args.concurrency}, prefetch {n}"
        )
        print(summary(label, rounds, load_before))


if __name__ == "__main__":
    main()
