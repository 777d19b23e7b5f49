"""``tokenline bench``: bulk enqueue rate, no-op throughput and pickup latency.

Each run measures only its own jobs, on a scratch store of its own
(:mod:`tokenline.drill._scratch`): a SQLite file in a fresh temporary directory, or a
fresh ``tokenline_bench_…`` schema on the PostgreSQL server ``--url`` names; it is
removed afterwards unless ``--keep``. ``TOKENLINE_URL`` is not read. The figures are
printed with the machine's core count and load average.

Phases:

1. bulk enqueue of ``--jobs`` no-op jobs (after ``--backlog`` jobs already queued);
   then up to 1,000 single-call enqueues (one ``enqueue`` each, on a queue no worker
   reads; cancelled afterwards);
2. throughput: worker processes start against a paused queue, so start-up is not
   timed; the queue is resumed and the clock runs until ``--jobs`` jobs succeeded
   (with ``--backlog``: jobs done in a fixed ``--window``, counted once);
3. latency: with the workers idle, single jobs are enqueued one at a time and the
   store's own timestamps give enqueue-to-start (p50, p99).
"""

from __future__ import annotations

import functools
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import click

from .._app import App
from .._errors import ConfigError
from .._jobs import JobState
from .._redact import redact
from ..drill._scratch import scratch_for
from ..stores import Store
from ._common import Seconds, Whole, console, interrupt_on_sigterm

QUEUE = "bench"
#: Jobs enqueued one call at a time, on a queue of their own that no worker reads.
SINGLE_CALLS = 1000
SINGLE_QUEUE = "bench.single"


def bench_app(url: str | None) -> App:
    """An app with the benchmark's no-op task (``None``: the URL from the environment)."""
    app = App(url)

    @app.task(name="bench.noop", queue=QUEUE)
    async def noop(ctx: object, i: int) -> None:
        """Do nothing: measures the queue, not the work."""

    return app


@functools.cache
def _workers_app() -> App:
    return bench_app(None)


def __getattr__(name: str) -> App:
    """``app``: the workers' app (``tokenline bench`` hands them its scratch store in
    TOKENLINE_URL). Built on first use, not at import: it reads the ``TOKENLINE_*``
    environment, and the command line imports this module for every command."""
    if name == "app":
        return _workers_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _enqueue(a: App, n: int, chunk: int = 10_000) -> tuple[float, int]:
    """Seconds to enqueue ``n`` no-op jobs in batches, and the last job's id."""
    t = time.perf_counter()
    last = 0
    for start in range(0, n, chunk):
        ids = a.enqueue_many("bench.noop", [(i,) for i in range(start, min(n, start + chunk))])
        last = ids[-1]
    return time.perf_counter() - t, last


def _succeeded(a: App) -> int:
    return sum(q.count(JobState.SUCCEEDED) for q in a.run(lambda s: s.queues_stats()))


def wait_for_all(
    a: App, jobs: int, last: int, procs: Sequence[subprocess.Popen[bytes]], started: float
) -> float:
    """Seconds from ``started`` (a :func:`time.perf_counter` reading) until ``jobs`` jobs
    have succeeded, ``last`` (the last enqueued, among the last to run on one queue of
    one priority) with them.

    Watched by ``last``'s primary key, which costs the store next to nothing; the
    count of every job, a read of the whole table (50 ms at 40,000 jobs on PostgreSQL,
    a third of a core when polled ten times a second), runs only once ``last`` is done.
    """

    async def finished(store: Store) -> bool:
        return (await store.job_get(job_id=last)).state == JobState.SUCCEEDED

    while True:
        if any(p.poll() is not None for p in procs):
            raise click.ClickException("a worker process exited early")
        if a.run(finished):
            took = time.perf_counter() - started
            if _succeeded(a) >= jobs:
                return took
            time.sleep(0.05)
        time.sleep(0.02)


def _latency(a: App, samples: int) -> list[float]:
    """Enqueue-to-start delays in seconds, by the store's clock, one job at a time."""
    delays = []
    for i in range(samples):
        jid = a.enqueue("bench.noop", i)

        async def started(store: Store, jid: int = jid) -> float | None:
            attempts = await store.job_attempts(job_id=jid)
            if not attempts:
                return None
            return attempts[0].started_at - (await store.job_get(job_id=jid)).created_at

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            delay = a.run(started)
            if delay is not None:
                delays.append(delay)
                break
            time.sleep(0.002)
        time.sleep(0.02)
    return delays


def _cpu_seconds(procs: list[subprocess.Popen[bytes]]) -> float | None:
    """User plus system CPU seconds the processes have used so far (Linux's /proc;
    ``None`` where it cannot be read)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/stat", encoding="ascii") as f:
                # The fields after the command name (in parentheses, which may hold spaces).
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _load() -> str:
    """The load average over 1, 5 and 15 minutes."""
    try:
        return " ".join(f"{n:.2f}" for n in os.getloadavg())
    except OSError:
        return "unknown"


@click.command()
@click.option(
    "--url",
    default=None,
    help="postgresql://… (a fresh schema, tokenline_bench_…, dropped afterwards), "
    "sqlite:///file (created, left in place; a file that already holds data is refused "
    "unless --overwrite, but bench's own file from an earlier run is recreated) or the "
    "split topology, "
    "split:?broker=redis://…&ledger=postgresql://… (a fresh key prefix and schema, both "
    "removed afterwards). Default: a SQLite file in a temporary directory, removed "
    "afterwards. TOKENLINE_URL is not read.",
)
@click.option("--keep", is_flag=True, help="Keep the store afterwards, and print where.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Delete and recreate the --url SQLite file even when it holds data bench did "
    "not put there.",
)
@click.option(
    "--jobs",
    type=Whole(100),
    default=20_000,
    show_default=True,
    help="No-op jobs enqueued and processed: the measured ones.",
)
@click.option(
    "--backlog",
    type=Whole(0),
    default=0,
    show_default=True,
    help="Jobs already queued before the measured ones (a deep queue).",
)
@click.option(
    "--workers",
    type=Whole(1, 64),
    default=2,
    show_default=True,
    help="Worker processes.",
)
@click.option(
    "--concurrency",
    type=Whole(1, 1000),
    default=50,
    show_default=True,
    help="Jobs each worker process runs at once.",
)
@click.option(
    "--latency-samples",
    type=Whole(0),
    default=200,
    show_default=True,
    help="Single jobs enqueued one at a time to time their pickup (0: none).",
)
@click.option(
    "--window",
    type=Seconds(1),
    default=10.0,
    show_default=True,
    help="With --backlog: seconds of processing to count.",
)
@interrupt_on_sigterm
def bench(
    url: str | None, keep: bool, overwrite: bool, jobs: int, backlog: int, workers: int,
    concurrency: int, latency_samples: int, window: float,
) -> None:  # fmt: skip
    """Measure bulk enqueue, no-op throughput with worker processes, and pickup latency.

    Runs on its own fresh store, only the one --url names (never TOKENLINE_URL), and
    removes it afterwards unless --keep."""
    try:
        scratch = scratch_for(url, keep=keep, prefix="tokenline_bench", overwrite=overwrite)
    except ConfigError as exc:
        raise click.BadParameter(exc.reason, param_hint="--url") from None
    load_before = _load()
    console.print(f"store: {redact(scratch.url)}", highlight=False, markup=False, soft_wrap=True)
    try:
        scratch.prepare({})
        _measure(
            scratch.url, jobs, backlog, workers, concurrency, latency_samples, window,
        )  # fmt: skip
    finally:
        kept = scratch.cleanup()
    console.print(
        f"machine: {os.cpu_count()} cores, load average (1/5/15 min) {load_before} before "
        f"the run, {_load()} after",
        highlight=False,
        soft_wrap=True,
    )
    for line in kept:
        console.print(f"left behind: {line}", highlight=False, markup=False, soft_wrap=True)


def _measure(
    url: str, jobs: int, backlog: int, workers: int, concurrency: int, latency_samples: int,
    window: float,
) -> None:  # fmt: skip
    a = bench_app(url)
    a.run(lambda s: s.queue_pause(queue=QUEUE))  # also opens the store: not timed
    if backlog:
        took, _ = _enqueue(a, backlog)
        console.print(f"backlog: {backlog:,} jobs queued in {took:.1f}s")
    took, last = _enqueue(a, jobs)
    console.print(f"bulk enqueue: {jobs:,} jobs in {took:.2f}s = {jobs / took:,.0f} jobs/s")
    single = min(jobs, SINGLE_CALLS)
    t = time.perf_counter()
    # On a queue no worker reads, cancelled afterwards: the throughput phase runs only
    # the bulk jobs.
    ids = [a.enqueue("bench.noop", i, queue=SINGLE_QUEUE) for i in range(single)]
    took = time.perf_counter() - t
    console.print(
        f"single-call enqueue: {single:,} jobs, one call each, in {took:.2f}s = "
        f"{single / took:,.0f} jobs/s"
    )
    a.run(lambda s: s.jobs_cancel(job_ids=ids, reason="bench: enqueue measured only"))
    env = {**os.environ, "TOKENLINE_URL": url}
    cmd = [
        sys.executable, "-m", "tokenline", "worker", "--app", "tokenline.cli.bench:app",
        "--queues", QUEUE, "--concurrency", str(concurrency), "--poll-interval", "0.05",
        "--log-level", "warning",
    ]  # fmt: skip
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL) for _ in range(workers)]
    try:
        deadline = time.monotonic() + 60
        while sum(w.state == "ready" for w in a.run(lambda s: s.workers_list())) < workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise click.ClickException("the workers did not start")
            time.sleep(0.05)
        cpu = _cpu_seconds(procs)
        t = time.perf_counter()
        a.run(lambda s: s.queue_resume(queue=QUEUE))
        if backlog:
            # Counting a deep queue is itself expensive: count once, after a fixed window.
            time.sleep(window)
            # The count sees the jobs committed when it starts: time the window up to there.
            took = time.perf_counter() - t
            jobs = _succeeded(a)
        else:
            took = wait_for_all(a, jobs, last, procs, t)
        spent = _cpu_seconds(procs)
        console.print(
            f"throughput: {jobs:,} no-op jobs, {workers} worker processes x {concurrency}, "
            f"in {took:.2f}s = {jobs / took:,.0f} jobs/s"
            + (f" (queue {backlog:,} deep)" if backlog else "")
        )
        if cpu is not None and spent is not None:
            # A little of it is idle heartbeats; over thousands of jobs, nearly nothing.
            console.print(
                f"worker CPU: {(spent - cpu) / jobs * 1e6:,.0f} µs per job "
                "(user + system time of the worker processes, all their threads)"
            )
        if latency_samples and not backlog:
            delays = sorted(_latency(a, latency_samples))
            if delays:
                p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
                console.print(
                    f"enqueue-to-start latency on idle workers ({len(delays)} samples): "
                    f"p50 {statistics.median(delays) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
                )
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
        a.close()
