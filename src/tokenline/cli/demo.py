"""``tokenline demo``: invoices under fire, on SQLite (the default) or PostgreSQL.

Enqueues a batch of invoice jobs keyed ``invoice:{order_id}``, starts worker processes,
SIGKILLs one and SIGSTOPs another past its lease mid-run, lets the rest finish, and
reports what the store and the ledger table say: every invoice written exactly once.

The store is a scratch store (:mod:`tokenline.drill._scratch`): a SQLite file in a fresh
temporary directory unless ``--url`` names one, a fresh schema on PostgreSQL; the
directory (with the workers' logs) and the schema are removed afterwards unless kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .._app import App
from .._errors import ConfigError
from .._jobs import JobState
from ..drill._scratch import ScratchStore, scratch_for
from ._common import Whole, console, interrupt_on_sigterm

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
    #: What the run left behind (kept stores, directories, a named SQLite file), with why.
    kept: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No lost job and no duplicate effect."""
        return (
            self.duplicates == 0
            and self.succeeded + self.dead == self.jobs
            and (self.invoices == self.succeeded)
        )


def _spawn(
    url: str, n: int, log_dir: Path, table: str
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    env = {**os.environ, "TOKENLINE_URL": url, "TOKENLINE_DEMO_TABLE": table}
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


_INVOICE_COLUMNS = (
    "order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL, job_id BIGINT NOT NULL, "
    "token BIGINT NOT NULL, worker TEXT NOT NULL"
)


def backend_for(url: str | None, *, keep: bool = False, overwrite: bool = False) -> ScratchStore:
    """The demo's scratch store for a ``sqlite:///file`` or ``postgresql://…`` URL;
    ``None``: a SQLite file in a fresh temporary directory. A named SQLite file holding
    data the demo did not put there is refused (a usage error) unless ``overwrite``."""
    try:
        return scratch_for(url, keep=keep, prefix="tokenline_demo", overwrite=overwrite)
    except ConfigError as exc:
        raise click.BadParameter(exc.reason, param_hint="--url") from None


def run_demo(
    backend: ScratchStore, jobs: int, workers: int, *, show_progress: bool = True
) -> DemoResult:
    """Run the demo on a fresh store and return its figures, read back from the store.

    The store is cleaned up afterwards; a failed run keeps the workers' logs, and says
    where on the console when it raises (otherwise in :attr:`DemoResult.kept`)."""
    result: DemoResult | None = None
    try:
        backend.prepare({"demo_invoices": _INVOICE_COLUMNS})
        result = _run(backend, jobs, workers, show_progress)
    finally:
        kept = backend.cleanup(keep_files=result is None or not result.ok)
        if result is None:
            _print_kept(kept)
    result.kept = kept
    return result


def _fenced(log: Path) -> int:
    """How many times the worker writing ``log`` fenced itself."""
    return log.read_text(errors="replace").count(" fenced: ")


def _print_kept(kept: list[str]) -> None:
    for line in kept:
        console.print(f"left behind: {line}", highlight=False, markup=False, soft_wrap=True)


def _run(backend: ScratchStore, jobs: int, workers: int, show_progress: bool) -> DemoResult:
    from .. import demo as demo_module

    app = App(backend.url)
    for task in demo_module.app.tasks.values():
        app.task(name=task.name, queue=task.queue, max_attempts=task.max_attempts)(task.fn)
    started = time.monotonic()
    for first in range(1, jobs + 1, 10_000):
        orders = range(first, min(jobs, first + 9_999) + 1)
        app.enqueue_many(
            "demo.invoice",
            [(order, 1000 + order % 500) for order in orders],
            keys=[f"invoice:{order}" for order in orders],
        )
    enqueue_seconds = time.monotonic() - started
    procs = _spawn(backend.url, workers, backend.work_dir, backend.tables["demo_invoices"])
    killed = stopped = False
    resume_at: float | None = None
    # After SIGCONT the resumed worker gets this long to notice its expired leases and
    # fence itself before the workers are stopped: a SIGTERM right after the SIGCONT
    # could otherwise end it before its watchdog has looked.
    fence_by: float | None = None
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
                    fence_by = time.monotonic() + LEASE_TTL * 2
                    progress.update(bar, description="SIGCONT worker 1: it must fence itself")
                if fence_by is not None and (
                    time.monotonic() >= fence_by or _fenced(procs[1][1]) > 0
                ):
                    fence_by = None
                if done >= jobs and resume_at is None and fence_by is None:
                    break
                if time.monotonic() - t0 > 600:
                    raise click.ClickException("demo did not finish within 600 s")
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
    fencings = sum(_fenced(log) for _, log in procs)
    return _collect(backend, jobs, enqueue_seconds, elapsed, fencings)


def _collect(
    backend: ScratchStore, jobs: int, enqueue_seconds: float, elapsed: float, fencings: int
) -> DemoResult:
    t = backend.tables
    one = backend.scalar
    return DemoResult(
        jobs=jobs,
        succeeded=one(f"SELECT count(*) FROM {t['jobs']} WHERE state = 'succeeded'"),
        dead=one(f"SELECT count(*) FROM {t['jobs']} WHERE state = 'dead'"),
        attempts=one(f"SELECT count(*) FROM {t['attempts']}"),
        retries=one(f"SELECT count(*) FROM {t['attempts']} WHERE outcome = 'retry'"),
        rescues=one(f"SELECT count(*) FROM {t['attempts']} WHERE outcome = 'lease_expired'"),
        stale_refused=one(f"SELECT count(*) FROM {t['stale']}"),
        fencings=fencings,
        invoices=one(f"SELECT count(*) FROM {t['demo_invoices']}"),
        duplicates=one(f"SELECT count(*) - count(DISTINCT order_id) FROM {t['demo_invoices']}"),
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
@click.option(
    "--jobs",
    type=Whole(10, 1_000_000),
    default=2000,
    show_default=True,
    help="Invoice jobs to enqueue.",
)
@click.option(
    "--workers",
    type=Whole(2, 32),
    default=4,
    show_default=True,
    help="Worker processes: one is SIGKILLed, another SIGSTOPped past its lease.",
)
@click.option(
    "--url",
    default=None,
    help="postgresql://… (a fresh schema, dropped afterwards) or sqlite:///file (created, "
    "left in place; a file that already holds data is refused unless --overwrite, but the "
    "demo's own file from an earlier run is recreated). Default: a SQLite file in a "
    "temporary directory, removed afterwards. TOKENLINE_URL is not read.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Delete and recreate the --url SQLite file even when it holds data the demo did "
    "not put there.",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the store (schema or temporary directory) and the workers' logs, and print where.",
)
@interrupt_on_sigterm
def demo(jobs: int, workers: int, url: str | None, overwrite: bool, keep: bool) -> None:
    """Invoices under fire: kill -9 one worker, SIGSTOP another past its lease.

    Runs on its own fresh store, only the one --url names (never TOKENLINE_URL), and
    removes it afterwards unless --keep; a failed run keeps the workers' logs and prints
    where they are."""
    backend = backend_for(url, keep=keep, overwrite=overwrite)
    console.print(
        f"{jobs} invoice jobs, {workers} worker processes, lease TTL {LEASE_TTL:g}s, "
        f"store {backend.url}",
        highlight=False,
    )
    result = run_demo(backend, jobs, workers)
    console.print(report(result))
    _print_kept(result.kept)
    if not result.ok:
        raise click.ClickException("invariant broken: lost job or duplicate effect")
    console.print("[green]every invoice written exactly once[/]")
