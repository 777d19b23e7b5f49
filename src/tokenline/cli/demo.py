"""``tokenline demo``: invoices under fire on the embedded SQLite store.

Enqueues a batch of invoice jobs keyed ``invoice:{order_id}``, starts worker processes,
SIGKILLs one and SIGSTOPs another past its lease mid-run, lets the rest finish, and
reports what the store and the ledger table say: every invoice written exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .._app import App
from .._jobs import JobState
from ..demo import create_tables
from ._common import console

LEASE_TTL = 2.0


@dataclass
class DemoResult:
    """Figures of one demo run, all read back from the store."""

    jobs: int
    succeeded: int
    dead: int
    attempts: int
    retries: int
    rescues: int
    stale_refused: int
    fencings: int
    invoices: int
    duplicates: int
    enqueue_seconds: float
    elapsed: float

    @property
    def ok(self) -> bool:
        """No lost job and no duplicate effect."""
        return (
            self.duplicates == 0
            and self.succeeded + self.dead == self.jobs
            and (self.invoices == self.succeeded)
        )


def _spawn(url: str, n: int, log_dir: Path) -> list[tuple[subprocess.Popen[bytes], Path]]:
    env = {**os.environ, "TOKENLINE_URL": url}
    procs = []
    for i in range(n):
        log = log_dir / f"worker-{i}.log"
        cmd = [
            sys.executable, "-m", "tokenline", "worker", "--app", "tokenline.demo:app",
            "--queues", "invoices", "--concurrency", "4",
            "--lease-ttl", str(LEASE_TTL), "--renew-interval", str(LEASE_TTL / 4),
            "--rescue-interval", "0.5", "--poll-interval", "0.05", "--drain-timeout", "5",
        ]  # fmt: skip
        with log.open("wb") as fh:
            procs.append((subprocess.Popen(cmd, env=env, stdout=fh, stderr=fh), log))
    return procs


def run_demo(db: Path, jobs: int, workers: int, *, show_progress: bool = True) -> DemoResult:
    """Run the demo against a fresh SQLite file at ``db`` and return its figures."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    url = f"sqlite:///{db}"
    app = App(url)
    from ..demo import invoice

    app.task(name="demo.invoice", queue="invoices", max_attempts=5)(invoice)
    with sqlite3.connect(db) as conn:
        create_tables(conn)
    started = time.monotonic()
    app.enqueue_many(
        "demo.invoice",
        [(order, 1000 + order % 500) for order in range(1, jobs + 1)],
        keys=[f"invoice:{order}" for order in range(1, jobs + 1)],
    )
    enqueue_seconds = time.monotonic() - started
    log_dir = Path(tempfile.mkdtemp(prefix="tokenline-demo-"))
    procs = _spawn(url, workers, log_dir)
    killed = stopped = False
    resume_at: float | None = None
    t0 = time.monotonic()
    try:
        with Progress(
            TextColumn("[bold]invoices"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.description}"), console=console, disable=not show_progress,
        ) as progress:  # fmt: skip
            bar = progress.add_task("", total=jobs)
            while True:
                stats = app.run(lambda s: s.queues_stats())
                done = sum(q.count(JobState.SUCCEEDED) + q.count(JobState.DEAD) for q in stats)
                progress.update(bar, completed=done)
                if not killed and done >= jobs * 0.2:
                    procs[0][0].send_signal(signal.SIGKILL)
                    killed = True
                    progress.update(bar, description="SIGKILL worker 0")
                if workers > 1 and not stopped and done >= jobs * 0.35:
                    procs[1][0].send_signal(signal.SIGSTOP)
                    stopped = True
                    resume_at = time.monotonic() + LEASE_TTL * 2.5
                    progress.update(bar, description="SIGSTOP worker 1 (past its lease)")
                if resume_at is not None and time.monotonic() >= resume_at:
                    procs[1][0].send_signal(signal.SIGCONT)
                    resume_at = None
                    progress.update(bar, description="SIGCONT worker 1: it must fence itself")
                if done >= jobs and resume_at is None:
                    break
                if time.monotonic() - t0 > 300:
                    raise click.ClickException("demo did not finish within 300 s")
                time.sleep(0.1)
        elapsed = time.monotonic() - t0
    finally:
        for proc, _ in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        app.close()
    fencings = sum(log.read_text(errors="replace").count(" fenced: ") for _, log in procs)
    return _collect(db, jobs, enqueue_seconds, elapsed, fencings)


def _collect(
    db: Path, jobs: int, enqueue_seconds: float, elapsed: float, fencings: int
) -> DemoResult:
    with contextlib.closing(sqlite3.connect(db)) as conn:

        def one(sql: str) -> int:
            return int(conn.execute(sql).fetchone()[0])

        return DemoResult(
            jobs=jobs,
            succeeded=one("SELECT count(*) FROM tokenline_jobs WHERE state = 'succeeded'"),
            dead=one("SELECT count(*) FROM tokenline_jobs WHERE state = 'dead'"),
            attempts=one("SELECT count(*) FROM tokenline_attempts"),
            retries=one("SELECT count(*) FROM tokenline_attempts WHERE outcome = 'retry'"),
            rescues=one("SELECT count(*) FROM tokenline_attempts WHERE outcome = 'lease_expired'"),
            stale_refused=one("SELECT count(*) FROM tokenline_stale_commits"),
            fencings=fencings,
            invoices=one("SELECT count(*) FROM demo_invoices"),
            duplicates=one("SELECT count(*) - count(DISTINCT order_id) FROM demo_invoices"),
            enqueue_seconds=enqueue_seconds,
            elapsed=elapsed,
        )


def report(r: DemoResult) -> Table:
    """The demo's closing table."""
    table = Table("", "", title="tokenline demo", show_header=False)
    rows = [
        ("jobs enqueued", f"{r.jobs} in {r.enqueue_seconds * 1000:.0f} ms"),
        ("jobs succeeded", str(r.succeeded)),
        ("jobs dead", str(r.dead)),
        ("attempts (all workers)", str(r.attempts)),
        ("retries (transient errors)", str(r.retries)),
        ("rescues (expired leases)", str(r.rescues)),
        ("stale commits refused by the store", str(r.stale_refused)),
        ("worker fencings", str(r.fencings)),
        ("invoices written", str(r.invoices)),
        ("duplicate effects", f"[bold {'green' if r.duplicates == 0 else 'red'}]{r.duplicates}[/]"),
        ("elapsed", f"{r.elapsed:.1f} s"),
        ("throughput", f"{r.succeeded / r.elapsed:.0f} jobs/s" if r.elapsed else "-"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


@click.command()
@click.option("--jobs", type=click.IntRange(10, 1_000_000), default=2000, show_default=True)
@click.option("--workers", type=click.IntRange(2, 32), default=4, show_default=True)
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("tokenline-demo.db"),
    show_default=True,
    help="SQLite file for the demo (recreated).",
)
def demo(jobs: int, workers: int, db: Path) -> None:
    """Invoices under fire: kill -9 one worker, SIGSTOP another past its lease."""
    console.print(
        f"{jobs} invoice jobs, {workers} worker processes, lease TTL {LEASE_TTL:g}s, store {db}",
        highlight=False,
    )
    result = run_demo(db, jobs, workers)
    console.print(report(result))
    if not result.ok:
        raise click.ClickException("invariant broken: lost job or duplicate effect")
    console.print("[green]every invoice written exactly once[/]")
