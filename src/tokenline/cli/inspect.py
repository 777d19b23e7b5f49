"""Read-only views and dead-letter actions: status, queues, workers, jobs, job, dlq."""

from __future__ import annotations

import time
from typing import Any

import click
from rich.table import Table

from .._errors import StoreError, TokenlineError
from .._jobs import JobState
from ..stores import Store
from ._common import (
    ago,
    app_option,
    console,
    reporting_errors,
    resolve_app,
    url_option,
    when,
    with_store,
)

STATES = [s.value for s in JobState]

#: Which limit an attempt's outcome counts toward (see tokenline._jobs).
_COUNTED = {
    "retry": "attempt",
    "dead": "attempt",
    "lease_expired": "lease expiry",
    "release": "nothing (given back)",
}


def _queues_table(stats: list[Any]) -> Table:
    table = Table("queue", *STATES, "oldest ready", "paused", title="queues")
    for s in stats:
        table.add_row(
            s.queue,
            *(str(s.counts.get(st, 0)) for st in STATES),
            ago(s.oldest_ready_age),
            "yes" if s.paused else "",
        )
    return table


def _skew(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:+.3f}s"


def _live(records: list[Any], now: float) -> list[Any]:
    return [w for w in records if w.expires_at > now and w.state != "stopped"]


def _workers_table(records: list[Any], now: float) -> Table:
    """Workers, their membership leases judged by ``now`` (the store's clock)."""
    table = Table(
        "worker", "state", "in flight", "queues", "heartbeat", "lease", "token", "clock skew",
        title="workers",
    )  # fmt: skip
    for w in records:
        alive = w.expires_at > now and w.state != "stopped"
        lease = f"expires in {ago(w.expires_at - now)}" if alive else "expired"
        table.add_row(
            w.id,
            w.state if alive or w.state == "stopped" else f"{w.state} (lost)",
            str(w.in_flight),
            ",".join(w.queues),
            f"{ago(now - w.heartbeat_at)} ago",
            lease,
            str(w.token),
            _skew(w.clock_skew),
        )
    return table


@click.command()
@app_option
@url_option
def status(app_spec: str | None, url: str | None) -> None:
    """Which channel is healthy, queue depth and age, workers by state."""
    app = resolve_app(app_spec, url)

    async def gather(store: Store) -> tuple[Any, ...]:
        started = time.monotonic()
        stats = await store.queues_stats()
        latency = time.monotonic() - started
        records = await store.workers_list()
        return latency, stats, records, await store.stale_commits(limit=5), await store.store_time()

    try:
        latency, stats, records, (stale_total, recent), now = with_store(app, gather)
    except StoreError as exc:
        console.print(f"store  [bold red]UNREACHABLE[/]  {app.url}\n  {exc}", highlight=False)
        raise SystemExit(1) from None
    except TokenlineError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise SystemExit(1) from None
    console.print(f"store  [green]ok[/]  {app.url}  ({latency * 1000:.1f} ms)", highlight=False)
    console.print(_queues_table(stats))
    console.print(_workers_table(_live(records, now), now))
    console.print(f"stale commits refused by the store: {stale_total}", highlight=False)
    for r in recent:
        console.print(
            f"  job {r.job_id} token {r.token} {r.operation} by {r.owner} at {when(r.at)}",
            highlight=False,
        )


@click.command()
@app_option
@url_option
def queues(app_spec: str | None, url: str | None) -> None:
    """Jobs per queue and state, oldest ready job, paused queues."""
    with reporting_errors():
        stats = with_store(resolve_app(app_spec, url), lambda s: s.queues_stats())
    console.print(_queues_table(stats))


@click.command()
@app_option
@url_option
@click.option("--all", "show_all", is_flag=True, help="Include stopped and expired workers.")
def workers(app_spec: str | None, url: str | None, show_all: bool) -> None:
    """Workers with their state, in-flight jobs, membership lease and clock skew (the
    worker's wall clock minus the store's; leases follow the store's clock)."""

    async def gather(store: Store) -> tuple[list[Any], float]:
        return await store.workers_list(), await store.store_time()

    with reporting_errors():
        records, now = with_store(resolve_app(app_spec, url), gather)
    console.print(_workers_table(records if show_all else _live(records, now), now))


def _jobs_table(items: list[Any], title: str) -> Table:
    table = Table(
        "id",
        "queue",
        "task",
        "state",
        "attempt",
        "token",
        "key",
        "run at",
        "last error",
        title=title,
    )
    for j in items:
        table.add_row(
            str(j.id),
            j.queue,
            j.task,
            j.state.value,
            f"{j.attempt}/{j.max_attempts}",
            str(j.lease_token),
            j.idempotency_key or "",
            when(j.run_at),
            (j.last_error or "")[:60],
        )
    return table


@click.command()
@app_option
@url_option
@click.option("--state", type=click.Choice(STATES), default=None, help="Only jobs in this state.")
@click.option("--queue", default=None, help="Only jobs of this queue.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
def jobs(
    app_spec: str | None, url: str | None, state: str | None, queue: str | None, limit: int
) -> None:
    """List jobs, newest first."""
    with reporting_errors():
        items = with_store(
            resolve_app(app_spec, url),
            lambda s: s.jobs_list(
                state=JobState(state) if state else None, queue=queue, limit=limit
            ),
        )
    console.print(_jobs_table(items, "jobs"))


@click.command()
@app_option
@url_option
@click.argument("job_id", type=int)
def job(app_spec: str | None, url: str | None, job_id: int) -> None:
    """One job: every attempt (worker, token, start, end, outcome, error class), the
    ledger effects it wrote and the duplicates recorded against it."""

    async def gather(store: Store) -> tuple[Any, Any, Any, Any]:
        j = await store.job_get(job_id=job_id)
        attempts = await store.job_attempts(job_id=job_id)
        if not store.capabilities.ledger:
            return j, attempts, [], []
        effects = await store.effects_list(job_id=job_id, limit=1000)
        dups = [d for d in await store.duplicates_list() if d.job_id == job_id]
        return j, attempts, effects, dups

    with reporting_errors():
        j, attempts, effects, dups = with_store(resolve_app(app_spec, url), gather)
    console.print(
        f"job {j.id}  task {j.task}  queue {j.queue}  state [bold]{j.state.value}[/]\n"
        f"args {j.args}\nkey {j.idempotency_key or '-'}  priority {j.priority}  "
        f"attempt {j.attempt}/{j.max_attempts}  "
        f"lease expiries {j.lease_expiries}/{j.max_lease_expiries}  token {j.lease_token}\n"
        f"lease owner {j.lease_owner or '-'}  expires {when(j.lease_expires_at)}\n"
        f"created {when(j.created_at)}  finished {when(j.finished_at)}\n"
        f"last error {j.last_error or '-'} ({j.error_class or '-'})",
        highlight=False,
    )
    table = Table(
        "attempt", "token", "worker", "started", "finished", "outcome", "counted as",
        "class", "error", title="attempts",
    )  # fmt: skip
    for a in attempts:
        table.add_row(
            str(a.attempt),
            str(a.token),
            a.owner,
            when(a.started_at),
            when(a.finished_at),
            a.outcome or "running",
            _COUNTED.get(a.outcome or "", ""),
            a.error_class or "",
            (a.error or "")[:60],
        )
    console.print(table)
    if effects:
        console.print(_effects_table(effects))
    for d in dups:
        console.print(
            f"{d.kind.value} {d.operation} on {d.key!r} by token {d.token} ({d.owner}) "
            f"at {when(d.at)}",
            highlight=False,
        )


def _effects_table(effects: list[Any]) -> Table:
    """Ledger effects last written by the job: key, status, token, runs."""
    table = Table(
        "key", "status", "token", "worker", "runs", "completed", "result / error",
        title="effects (last written by this job)",
    )  # fmt: skip
    for e in effects:
        table.add_row(
            e.key,
            e.status.value,
            str(e.token),
            e.owner,
            str(e.runs),
            when(e.completed_at),
            (e.result if e.result is not None else e.error or "")[:60],
        )
    return table


@click.group()
def dlq() -> None:
    """Inspect, retry or discard dead jobs."""


@dlq.command("list")
@app_option
@url_option
@click.option("--queue", default=None)
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
def dlq_list(app_spec: str | None, url: str | None, queue: str | None, limit: int) -> None:
    """Dead jobs, newest first, with the reason."""
    with reporting_errors():
        items = with_store(
            resolve_app(app_spec, url),
            lambda s: s.jobs_list(state=JobState.DEAD, queue=queue, limit=limit),
        )
    console.print(_jobs_table(items, "dead jobs"))


def _dead_ids(store: Store, ids: tuple[int, ...], take_all: bool) -> Any:
    async def pick() -> list[int]:
        if take_all:
            return [j.id for j in await store.jobs_list(state=JobState.DEAD, limit=1_000_000)]
        return list(ids)

    return pick()


@dlq.command("retry")
@app_option
@url_option
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--all", "take_all", is_flag=True, help="Every dead job.")
def dlq_retry(
    app_spec: str | None, url: str | None, job_ids: tuple[int, ...], take_all: bool
) -> None:
    """Move dead jobs back to the queue with a fresh attempt budget."""
    if not job_ids and not take_all:
        raise click.UsageError("give job ids or --all")

    async def run(store: Store) -> int:
        return await store.jobs_retry_dead(job_ids=await _dead_ids(store, job_ids, take_all))

    with reporting_errors():
        n = with_store(resolve_app(app_spec, url), run)
    console.print(f"requeued {n} dead job(s)")


@dlq.command("discard")
@app_option
@url_option
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--all", "take_all", is_flag=True, help="Every dead job.")
def dlq_discard(
    app_spec: str | None, url: str | None, job_ids: tuple[int, ...], take_all: bool
) -> None:
    """Mark dead jobs cancelled (kept for the record, never run again)."""
    if not job_ids and not take_all:
        raise click.UsageError("give job ids or --all")

    async def run(store: Store) -> int:
        ids = await _dead_ids(store, job_ids, take_all)
        dead = [i for i in ids if (await store.job_get(job_id=i)).state is JobState.DEAD]
        return await store.jobs_cancel(job_ids=dead, reason="discarded from the dead-letter queue")

    with reporting_errors():
        n = with_store(resolve_app(app_spec, url), run)
    console.print(f"discarded {n} dead job(s)")
