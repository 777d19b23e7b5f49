"""``tokenline bench``: no-op throughput with worker processes and bulk enqueue rate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from .._app import App
from .._jobs import JobState
from ._common import console


def bench_app(url: str) -> App:
    """An app with the benchmark's no-op task."""
    app = App(url)

    @app.task(name="bench.noop", queue="bench")
    async def noop(ctx: object, i: int) -> None:
        """Do nothing: measures the queue, not the work."""

    return app


app = bench_app(os.environ.get("TOKENLINE_URL", "sqlite:///tokenline-bench.db"))


@click.command()
@click.option("--url", default=None, help="Store URL [default: a fresh SQLite file].")
@click.option("--jobs", type=click.IntRange(100), default=20_000, show_default=True)
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 1000), default=50, show_default=True)
def bench(url: str | None, jobs: int, workers: int, concurrency: int) -> None:
    """Bulk-enqueue JOBS no-op jobs, then time WORKERS processes running them."""
    if url is None:
        url = f"sqlite:///{Path(tempfile.mkdtemp(prefix='tokenline-bench-')) / 'bench.db'}"
    a = bench_app(url)
    t = time.perf_counter()
    for start in range(0, jobs, 10_000):
        a.enqueue_many("bench.noop", [(i,) for i in range(start, min(jobs, start + 10_000))])
    enq = time.perf_counter() - t
    console.print(f"bulk enqueue: {jobs} jobs in {enq:.2f}s = {jobs / enq:,.0f} jobs/s")
    env = {**os.environ, "TOKENLINE_URL": url}
    cmd = [
        sys.executable, "-m", "tokenline", "worker", "--app", "tokenline.cli.bench:app",
        "--queues", "bench", "--concurrency", str(concurrency), "--poll-interval", "0.05",
        "--log-level", "warning",
    ]  # fmt: skip
    t = time.perf_counter()
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL) for _ in range(workers)]
    try:
        while True:
            (stats,) = a.run(lambda s: s.queues_stats())
            if stats.count(JobState.SUCCEEDED) >= jobs:
                break
            if any(p.poll() is not None for p in procs):
                raise click.ClickException("a worker process exited early")
            time.sleep(0.05)
        took = time.perf_counter() - t
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
        a.close()
    console.print(
        f"processed: {jobs} no-op jobs with {workers} worker processes x {concurrency} "
        f"in {took:.2f}s = {jobs / took:,.0f} jobs/s (includes worker start-up; "
        f"{os.cpu_count()} cores)"
    )
