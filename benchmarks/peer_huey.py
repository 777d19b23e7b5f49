"""The scenario of ``scenario_bench.py``, run on Huey (Redis), for a figure measured on
the same machine in the same run rather than quoted.

``N`` jobs are enqueued one call at a time from plain synchronous code (timed: enqueues
per second); then ``--workers`` ``huey_consumer`` processes with one worker thread each
process them, every job doing one autocommit ``INSERT`` into a table on PostgreSQL. Huey
has no paused queue to start from, so the processing rate is read off the sink: jobs per
second between the first row's and the last row's insert time (the consumers' start-up
is excluded, as in ``scenario_bench.py``). Afterwards the sink must hold every job
exactly once; the run fails otherwise.

Huey is not a dependency of tokenline: ``pip install -e ".[peers]"`` first. Redis at
``--redis`` (default: the local one) is used under a fresh queue name, removed after.

    python benchmarks/peer_huey.py [--jobs 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scenario_bench import (
    DEFAULT_SINK,
    SINK_ENV,
    TABLE_ENV,
    _machine_busy,
    load_average,
    summary,
)

from tokenline.cli.bench import _cpu_seconds

NAME_ENV = "TOKENLINE_PEER_QUEUE"
REDIS_ENV = "TOKENLINE_PEER_REDIS"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def huey_app(name: str, redis_url: str) -> Any:
    """The Huey instance with the scenario's task: one autocommit INSERT per job."""
    from huey import RedisHuey

    huey = RedisHuey(name, url=redis_url)
    state: dict[str, Any] = {}

    def insert(i: int) -> None:
        """Insert one row into the sink table on this thread's autocommit connection."""
        import psycopg

        conn = state.get("conn")
        if conn is None or conn.closed:
            conn = psycopg.connect(os.environ[SINK_ENV], autocommit=True)
            state["conn"] = conn
        conn.execute(f"INSERT INTO {os.environ[TABLE_ENV]} (i) VALUES (%s)", (i,))

    # Huey names a task after its module: the same name whether this file runs as the
    # script (enqueuing) or is imported by the consumers.
    insert.__module__ = "peer_huey"
    huey.scenario_insert = huey.task(name="scenario.insert")(insert)
    return huey


#: The consumers' instance: the runner names its queue in the environment.
huey = (
    huey_app(os.environ[NAME_ENV], os.environ.get(REDIS_ENV, DEFAULT_REDIS))
    if os.environ.get(NAME_ENV)
    else None
)


def one_round(sink: str, redis_url: str, jobs: int, workers: int) -> dict[str, Any]:
    """Run the scenario once under a fresh queue name and sink table; return its figures."""
    import psycopg

    name = f"tokenline_peer_{secrets.token_hex(4)}"
    table = f"tokenline_peer_sink_{secrets.token_hex(4)}"
    with psycopg.connect(sink, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (i integer NOT NULL, "  # type: ignore[arg-type]
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    app = huey_app(name, redis_url)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        t = time.perf_counter()
        for i in range(jobs):
            app.scenario_insert(i)
        enqueue_s = time.perf_counter() - t
        env = {
            **os.environ,
            NAME_ENV: name,
            REDIS_ENV: redis_url,
            SINK_ENV: sink,
            TABLE_ENV: table,
            # Ahead of the caller's own path, not instead of it: a run against another
            # checkout (PYTHONPATH=…/src) must have its workers run that code too.
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p
            ),
        }
        consumer = Path(sys.executable).with_name("huey_consumer")
        cmd = [str(consumer), "peer_huey.huey", "-w", "1", "-k", "thread", "-d", "0.05", "-q"]
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL) for _ in range(workers)]
        deadline = time.monotonic() + 600
        # CPU is counted from the first job seen done (the consumers' start-up is not),
        # as the processing rate is; both are read at the same moments.
        cpu_before: float | None = None
        busy_before = (0, 0)
        with psycopg.connect(sink, autocommit=True) as conn:
            while True:
                row = conn.execute(
                    f"SELECT count(*), count(DISTINCT i), "  # type: ignore[arg-type]
                    f"extract(epoch FROM max(at) - min(at)) FROM {table}"
                ).fetchone()
                assert row is not None
                if row[0] and cpu_before is None:
                    cpu_before, busy_before = _cpu_seconds(procs), _machine_busy()
                    first = row[0]
                if row[0] >= jobs:
                    cpu_after, busy_after = _cpu_seconds(procs), _machine_busy()
                    break
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit(f"the consumers stopped with {row[0]} of {jobs} rows")
                time.sleep(0.05)
        if row[0] != jobs or row[1] != jobs:
            raise SystemExit(f"sink holds {row[0]} rows, {row[1]} distinct; expected {jobs}")
        return {
            "system": "huey",
            "jobs": jobs,
            "workers": workers,
            "concurrency": 1,
            "enqueue_per_s": round(jobs / enqueue_s),
            "processed_per_s": round((jobs - 1) / float(row[2])),
            # As in scenario_bench.py: the consumers' CPU per job, and how busy the
            # machine's cores were meanwhile.
            "worker_cpu_us_per_job": (
                round((cpu_after - cpu_before) / (jobs - first) * 1e6)
                if cpu_before is not None and cpu_after is not None and jobs > first
                else None
            ),
            "machine_busy": round(
                (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1]), 2
            ),
        }
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        app.storage.flush_queue()
        app.storage.flush_results()
        with psycopg.connect(sink, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the rounds, print each round and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sink", default=DEFAULT_SINK, help="PostgreSQL for the jobs' INSERTs")
    p.add_argument("--redis", default=DEFAULT_REDIS, help="the Redis Huey queues on")
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    try:
        import huey as _huey  # noqa: F401
    except ImportError:
        raise SystemExit('this benchmark runs Huey: pip install -e ".[peers]"') from None
    load_before = load_average()
    rounds = []
    for _ in range(args.rounds):
        r = one_round(args.sink, args.redis, args.jobs, args.workers)
        print(json.dumps(r), flush=True)
        rounds.append(r)
    label = f"huey (redis): {args.jobs} jobs, {args.workers} workers x 1"
    print(summary(label, rounds, load_before))


if __name__ == "__main__":
    main()
