"""Read-only views: queues, workers, jobs, job; and the JSON and tables they share
with ``status`` and ``dlq``.

Every listing takes ``--json``; its keys are listed in the command's help and are
stable. Times in JSON are epoch seconds by the store's clock (``null`` when unset);
ages and durations are seconds.
"""

from __future__ import annotations

import json
from typing import Any

import click
from rich.markup import escape

from .._jobs import Attempt, Job, JobState, QueueStats, StaleCommit, WorkerRecord
from .._logging import printable
from .._records import Duplicate, DuplicateKind, EffectRecord
from ..health import alive, live, worker_state
from ..stores import Store
from ..stores._repairs import RERUN
from ..stores.base import ResourceLease
from ._common import (
    ID,
    Col,
    Whole,
    ago,
    app_option,
    bytes_text,
    console,
    json_option,
    plural,
    print_json,
    queue_name,
    reporting_errors,
    resolve_app,
    show,
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
#: Outcomes whose attempt stays counted in ``Job.attempt`` (``None``: still running).
_KEPT = {None, "succeeded", "retry", "dead"}


# -- JSON ---------------------------------------------------------------------------------
def _decoded(text: str | None) -> Any:
    """JSON text as its value; text that is not JSON stays as it is, and so do bytes
    (they print as :func:`~tokenline.cli._common.bytes_text` says, not as whatever JSON
    they might decode to)."""
    if text is None or not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def job_json(j: Job) -> dict[str, Any]:
    """A job for ``--json``: every stored field, its payload decoded."""
    payload = _decoded(j.args)
    if isinstance(payload, dict) and set(payload) <= {"args", "kwargs"}:
        args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    else:  # written by something other than App.enqueue: shown as stored
        args, kwargs = payload, {}
    return {
        "id": j.id,
        "queue": j.queue,
        "task": j.task,
        "state": j.state.value,
        "args": args,
        "kwargs": kwargs,
        "idempotency_key": j.idempotency_key,
        "priority": j.priority,
        "attempt": j.attempt,
        "max_attempts": j.max_attempts,
        "lease_expiries": j.lease_expiries,
        "max_lease_expiries": j.max_lease_expiries,
        "lease_token": j.lease_token,
        "lease_owner": j.lease_owner,
        "lease_expires_at": j.lease_expires_at,
        "run_at": j.run_at,
        "created_at": j.created_at,
        "updated_at": j.updated_at,
        "finished_at": j.finished_at,
        "timeout": j.timeout,
        "last_error": j.last_error,
        "error_class": j.error_class,
    }


def queue_json(s: QueueStats) -> dict[str, Any]:
    """A queue's counts for ``--json``."""
    return {
        "queue": s.queue,
        "counts": {st: int(s.counts.get(st, 0)) for st in STATES},
        "oldest_ready_age": s.oldest_ready_age,
        "paused": s.paused,
    }


def worker_json(w: WorkerRecord, now: float) -> dict[str, Any]:
    """A worker's membership for ``--json``, judged alive by ``now`` (the store's clock)."""
    return {
        "id": w.id,
        "host": w.host,
        "pid": w.pid,
        "state": w.state,
        "alive": alive(w, now),
        "queues": list(w.queues),
        "concurrency": w.concurrency,
        "concurrency_limit": w.concurrency_limit,
        "in_flight": w.in_flight,
        "drain_requested": w.drain_requested,
        "token": w.token,
        "started_at": w.started_at,
        "heartbeat_at": w.heartbeat_at,
        "expires_at": w.expires_at,
        "clock_skew": w.clock_skew,
    }


def _attempt_json(a: Attempt) -> dict[str, Any]:
    return {
        "attempt": a.attempt,
        "token": a.token,
        "owner": a.owner,
        "started_at": a.started_at,
        "finished_at": a.finished_at,
        "outcome": a.outcome,
        "counted_as": _COUNTED.get(a.outcome or ""),
        "error": a.error,
        "error_class": a.error_class,
    }


def _effect_json(e: EffectRecord) -> dict[str, Any]:
    return {
        "key": e.key,
        "status": e.status.value,
        "result": _decoded(e.result),
        "error": e.error,
        "token": e.token,
        "owner": e.owner,
        "runs": e.runs,
        "created_at": e.created_at,
        "updated_at": e.updated_at,
        "completed_at": e.completed_at,
    }


def duplicate_json(d: Duplicate) -> dict[str, Any]:
    """A recorded duplicate for ``--json``."""
    return {
        "key": d.key,
        "kind": d.kind.value,
        "operation": d.operation,
        "job_id": d.job_id,
        "token": d.token,
        "owner": d.owner,
        "at": d.at,
    }


def stale_json(r: StaleCommit) -> dict[str, Any]:
    """A refused stale commit for ``--json``."""
    return {"job_id": r.job_id, "token": r.token, "owner": r.owner, "operation": r.operation,
            "at": r.at}  # fmt: skip


# -- tables -------------------------------------------------------------------------------
def show_queues(stats: list[QueueStats]) -> None:
    """Jobs per queue and state; "cancelled" is the first column a narrow terminal drops."""
    cols = [
        Col("queue"),
        *(Col(st, justify="right", optional=1 if st == "cancelled" else 0) for st in STATES),
        Col("oldest ready", "wrap", justify="right"),
        Col("paused"),
    ]
    rows = [
        [
            s.queue,
            *(str(s.counts.get(st, 0)) for st in STATES),
            ago(s.oldest_ready_age),
            "yes" if s.paused else "",
        ]
        for s in stats
    ]
    show("queues", cols, rows)


def _skew(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:+.3f}s"


def _limit(w: WorkerRecord) -> str:
    """The adaptive limit out of the configured concurrency ("-" until reported)."""
    return f"{'-' if w.concurrency_limit is None else w.concurrency_limit}/{w.concurrency}"


def show_workers(records: list[WorkerRecord], now: float) -> None:
    """Workers, their membership leases judged by ``now`` (the store's clock)."""
    cols = [
        Col("worker"),
        Col("state"),
        Col("in flight", "wrap", justify="right"),
        Col("limit", justify="right", optional=3),
        Col("queues", "wrap"),
        Col("heartbeat", "wrap"),
        Col("lease", "wrap"),
        Col("token", justify="right", optional=2),
        Col("clock skew", "wrap", justify="right", optional=1),
    ]
    rows = []
    for w in records:
        up = alive(w, now)
        rows.append(
            [
                w.id,
                worker_state(w, now),
                str(w.in_flight),
                _limit(w),
                ", ".join(w.queues),
                f"{ago(now - w.heartbeat_at)} ago",
                f"expires in {ago(w.expires_at - now)}" if up else "expired",
                str(w.token),
                _skew(w.clock_skew),
            ]
        )
    show("workers", cols, rows)


def show_jobs(items: list[Job], title: str) -> None:
    """A listing of jobs; token and run time give way first on a narrow terminal."""
    cols = [
        Col("id", justify="right"),
        Col("queue"),
        Col("task"),
        Col("state"),
        Col("attempt", justify="right"),
        Col("token", justify="right", optional=1),
        Col("key"),
        Col("run at", "wrap", optional=2),
        Col("last error", "text"),
    ]
    rows = [
        [
            str(j.id),
            j.queue,
            j.task,
            j.state.value,
            f"{j.attempt}/{j.max_attempts}",
            str(j.lease_token),
            j.idempotency_key or "",
            when(j.run_at),
            j.last_error or "",
        ]
        for j in items
    ]
    show(title, cols, rows)


# -- listings -----------------------------------------------------------------------------
@click.command()
@app_option
@url_option
@json_option
def queues(app_spec: str | None, url: str | None, as_json: bool) -> None:
    """Jobs per queue and state, the oldest ready job's age, paused queues.

    --json: a list of {queue, counts (one number per state), oldest_ready_age
    (seconds, or null), paused}.
    """
    with reporting_errors():
        stats = with_store(
            resolve_app(app_spec, url, existing=True, ledger=False),
            lambda s: s.queues_stats(),
            ledger=False,
        )
    if as_json:
        print_json([queue_json(s) for s in stats])
    else:
        show_queues(stats)


@click.command()
@app_option
@url_option
@click.option("--all", "show_all", is_flag=True, help="Include stopped and expired workers.")
@json_option
def workers(app_spec: str | None, url: str | None, show_all: bool, as_json: bool) -> None:
    """Workers with their state, in-flight jobs, limit, lease and clock skew.

    A worker's membership lease follows the store's clock; its clock skew is its wall
    clock minus the store's, as it measured it. Its limit is the adaptive concurrency
    limit it last reported, out of its configured concurrency ("-" until reported). A
    worker asked to drain that has not begun shows "(drain requested)" after its state.

    --json: a list of {id, host, pid, state, alive, queues, concurrency,
    concurrency_limit (or null), in_flight, drain_requested, token, started_at,
    heartbeat_at, expires_at, clock_skew (seconds, or null), leader_term (the
    maintenance term this worker leads, or null)}.

    Below the table: the maintenance leader (a worker, or a dedicated ``tokenline
    maintenance`` process) and its term, or that none leads now.
    """

    async def gather(store: Store) -> tuple[list[WorkerRecord], ResourceLease | None, float]:
        from .maintenance import current_leader

        records = await store.workers_list()  # before the clock: see current_leader
        leader, now = await current_leader(store)
        return records, leader, now

    with reporting_errors():
        records, leader, now = with_store(
            resolve_app(app_spec, url, existing=True, ledger=False), gather, ledger=False
        )
    shown = records if show_all else live(records, now)
    if as_json:
        print_json([_with_term(worker_json(w, now), w, leader) for w in shown])
    else:
        show_workers(shown, now)
        if leader is None:
            console.print("maintenance leader: none now", highlight=False)
        else:
            console.print(
                f"maintenance leader: {escape(leader.owner)}, term {leader.token} "
                f"(lease expires in {ago(leader.expires_at - now)})",
                highlight=False,
            )


def _with_term(
    row: dict[str, Any], w: WorkerRecord, leader: ResourceLease | None
) -> dict[str, Any]:
    row["leader_term"] = leader.token if leader is not None and leader.owner == w.id else None
    return row


#: ``--limit`` of the job listings.
LIMIT_HELP = "Most jobs to list, newest first."


@click.command()
@app_option
@url_option
@click.option("--state", type=click.Choice(STATES), default=None, help="Only jobs in this state.")
@click.option("--queue", default=None, callback=queue_name, help="Only jobs of this queue.")
@click.option(
    "--limit",
    type=Whole(1, 10_000),
    default=50,
    show_default=True,
    help=LIMIT_HELP,
)
@json_option
def jobs(
    app_spec: str | None,
    url: str | None,
    state: str | None,
    queue: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List jobs, newest first.

    --json: a list of {id, queue, task, state, args, kwargs, idempotency_key,
    priority, attempt, max_attempts, lease_expiries, max_lease_expiries, lease_token,
    lease_owner, lease_expires_at, run_at, created_at, updated_at, finished_at, timeout,
    last_error, error_class}.
    """
    with reporting_errors():
        items = with_store(
            resolve_app(app_spec, url, existing=True, ledger=False),
            lambda s: s.jobs_list(
                state=JobState(state) if state else None,
                queue=queue,
                limit=limit,
                # The table shows no arguments; --json shows them whole.
                args_limit=None if as_json else 0,
            ),
            ledger=False,
        )
    if as_json:
        print_json([job_json(j) for j in items])
    else:
        show_jobs(items, "jobs")


def earlier_attempts(job: Job, attempts: list[Attempt]) -> int:
    """Attempts that counted before the job's last retry from the dead-letter queue.

    A DLQ retry starts the job on a fresh budget (attempt 0), so the attempts that
    counted in its history, less the ones its budget holds now, are the earlier ones.
    """
    kept = sum(1 for a in attempts if a.outcome in _KEPT)
    return max(0, kept - job.attempt)


def _attempt_line(j: Job, earlier: int) -> str:
    line = f"attempt {j.attempt}/{j.max_attempts}"
    if earlier:
        line += f" (retried from the DLQ; {plural(earlier, 'earlier attempt')})"
    return line


def _show_job(j: Job, attempts: list[Attempt], effects: list[Any], dups: list[Any]) -> None:
    def e(value: object) -> str:
        # A stored line break (a handler's error says what it likes) would start a line
        # of its own here, one that reads as tokenline's: written as \x0a, as in logs.
        text = bytes_text(value) if isinstance(value, bytes) else str(value)
        return escape(printable(text, newlines=False))

    earlier = earlier_attempts(j, attempts)
    console.print(
        f"job {j.id}  task {e(j.task)}  queue {e(j.queue)}  state [bold]{j.state.value}[/]\n"
        f"args {e(j.args)}\nkey {e(j.idempotency_key or '-')}  priority {j.priority}  "
        f"{_attempt_line(j, earlier)}  "
        f"lease expiries {j.lease_expiries}/{j.max_lease_expiries}  token {j.lease_token}\n"
        f"lease owner {e(j.lease_owner or '-')}  expires {when(j.lease_expires_at)}\n"
        f"created {when(j.created_at)}  finished {when(j.finished_at)}\n"
        f"last error {e(j.last_error or '-')} ({e(j.error_class or '-')})",
        highlight=False,
    )
    cols = [
        Col("attempt", justify="right"),
        Col("token", justify="right"),
        Col("worker"),
        Col("started", "wrap"),
        Col("finished", "wrap"),
        Col("outcome"),
        Col("counted as", "wrap"),
        Col("class", optional=1),
        Col("error", "text"),
    ]
    rows = [
        [
            str(a.attempt),
            str(a.token),
            a.owner,
            when(a.started_at),
            when(a.finished_at),
            a.outcome or "running",
            _COUNTED.get(a.outcome or "", ""),
            a.error_class or "",
            a.error or "",
        ]
        for a in attempts
    ]
    show("attempts", cols, rows)
    if effects:
        _show_effects(effects)
    for d in dups:
        # A rerun is stored as a repeat whose operation says so; `audit duplicates`
        # counts it as a rerun, and so is it named here.
        kind = "rerun" if d.kind is DuplicateKind.REPEAT and d.operation == RERUN else d.kind.value
        console.print(
            f"{kind} {d.operation} on {d.key!r} by token {d.token} ({d.owner}) at {when(d.at)}",
            highlight=False,
            markup=False,
        )


@click.command()
@app_option
@url_option
@click.argument("job_id", type=ID)
@json_option
def job(app_spec: str | None, url: str | None, job_id: int, as_json: bool) -> None:
    """One job with its attempts, effects and duplicates.

    Every attempt with its worker, token, start, end, outcome and what it counted
    toward; the ledger effects the job wrote last; the duplicates recorded against it.
    After a retry from the dead-letter queue the job has a fresh budget and the
    attempt line says how many attempts came before it.

    --json: the keys of `jobs --json`, and earlier_attempts (attempts that counted
    before its last DLQ retry), attempts (attempt, token, owner, started_at,
    finished_at, outcome, counted_as, error, error_class), effects (key, status,
    result, error, token, owner, runs, created_at, updated_at, completed_at) and
    duplicates (key, kind, operation, job_id, token, owner, at).
    """

    async def gather(store: Store) -> tuple[Any, Any, Any, Any]:
        j = await store.job_get(job_id=job_id)
        attempts = await store.job_attempts(job_id=job_id)
        if not store.capabilities.ledger:
            return j, attempts, [], []
        effects = await store.effects_list(job_id=job_id, limit=1000)
        dups = [d for d in await store.duplicates_list() if d.job_id == job_id]
        return j, attempts, effects, dups

    with reporting_errors():
        j, attempts, effects, dups = with_store(resolve_app(app_spec, url, existing=True), gather)
    if as_json:
        print_json(
            {
                **job_json(j),
                "earlier_attempts": earlier_attempts(j, attempts),
                "attempts": [_attempt_json(a) for a in attempts],
                "effects": [_effect_json(x) for x in effects],
                "duplicates": [duplicate_json(d) for d in dups],
            }
        )
    else:
        _show_job(j, attempts, effects, dups)


def _show_effects(effects: list[EffectRecord]) -> None:
    """Ledger effects last written by the job: key, status, token, runs."""
    cols = [
        Col("key"),
        Col("status"),
        Col("token", justify="right"),
        Col("worker"),
        Col("runs", justify="right"),
        Col("completed", "wrap"),
        Col("result / error", "text"),
    ]
    rows = [
        [
            e.key,
            e.status.value,
            str(e.token),
            e.owner,
            str(e.runs),
            when(e.completed_at),
            e.result if e.result is not None else e.error or "",
        ]
        for e in effects
    ]
    show("effects (last written by this job)", cols, rows)
