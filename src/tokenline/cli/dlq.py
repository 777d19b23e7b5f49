"""``tokenline dlq``: list, retry or discard dead jobs, naming each id not acted on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import click

from .._errors import JobNotFoundError
from .._jobs import JobState
from ..stores import Store
from ._common import (
    ID,
    CommandGroup,
    Whole,
    app_option,
    console,
    err_console,
    json_option,
    plural,
    print_json,
    queue_name,
    reporting_errors,
    resolve_app,
    url_option,
    with_store,
)
from .inspect import LIMIT_HELP, job_json, show_jobs

__all__ = ["dlq"]


@click.group(cls=CommandGroup)
def dlq() -> None:
    """Inspect, retry or discard dead jobs."""


@dlq.command("list")
@app_option
@url_option
@click.option("--queue", default=None, callback=queue_name, help="Only dead jobs of this queue.")
@click.option(
    "--limit",
    type=Whole(1, 10_000),
    default=50,
    show_default=True,
    help=LIMIT_HELP,
)
@json_option
def dlq_list(
    app_spec: str | None, url: str | None, queue: str | None, limit: int, as_json: bool
) -> None:
    """Dead jobs, newest first, with the reason.

    --json: a list of jobs with the keys of `jobs --json`.
    """
    with reporting_errors():
        items = with_store(
            resolve_app(app_spec, url, existing=True, ledger=False),
            lambda s: s.jobs_list(
                state=JobState.DEAD, queue=queue, limit=limit, args_limit=None if as_json else 0
            ),
            ledger=False,
        )
    if as_json:
        print_json([job_json(j) for j in items])
    else:
        show_jobs(items, "dead jobs")


async def _sort_out(
    store: Store, ids: tuple[int, ...], take_all: bool
) -> tuple[list[int], list[tuple[int, str]]]:
    """The dead jobs among ``ids`` (every dead job with ``take_all``), and each other id
    with the reason it cannot be acted on."""
    if take_all:
        listed = await store.jobs_list(state=JobState.DEAD, limit=1_000_000, args_limit=0)
        return [j.id for j in listed], []
    dead: list[int] = []
    refused: list[tuple[int, str]] = []
    for jid in dict.fromkeys(ids):  # each id once, in the order given
        try:
            state = (await store.job_get(job_id=jid)).state
        except JobNotFoundError:
            refused.append((jid, "no such job"))
            continue
        if state is JobState.DEAD:
            dead.append(jid)
        else:
            refused.append((jid, f"not dead: its state is {state.value}"))
    return dead, refused


def _act_on_dead(
    app_spec: str | None,
    url: str | None,
    job_ids: tuple[int, ...],
    take_all: bool,
    act: Callable[[Store, list[int]], Awaitable[int]],
) -> tuple[int, list[int], list[tuple[int, str]]]:
    """Sort the ids out, act on the dead ones; how many were acted on, and the rest."""
    if not job_ids and not take_all:
        raise click.UsageError("give job ids or --all")
    if job_ids and take_all:
        # Either would be a guess: --all acts on every dead job, not only those named.
        raise click.UsageError(
            f"give job ids ({', '.join(map(str, job_ids))}) or --all, not both: --all "
            "acts on every dead job"
        )

    async def run(store: Store) -> tuple[int, list[int], list[tuple[int, str]]]:
        dead, refused = await _sort_out(store, job_ids, take_all)
        done = await act(store, dead) if dead else 0
        return done, dead, refused

    with reporting_errors(unsure="see `tokenline dlq list` and `tokenline job ID`"):
        return with_store(
            resolve_app(app_spec, url, existing=True, ledger=False), run, ledger=False
        )


def _report_dead(verb: str, done: int, dead: list[int], refused: list[tuple[int, str]]) -> None:
    """Say what was done and what was not; exit 1 when any id was not acted on."""
    # Name the jobs when there are few; after --all, the count says enough.
    ids = f": {', '.join(map(str, dead))}" if 0 < done == len(dead) <= 20 else ""
    console.print(f"{verb} {plural(done, 'dead job')}{ids}", highlight=False)
    for jid, why in refused:
        err_console.print(f"not {verb}: job {jid}: {why}", highlight=False, markup=False)
    if done < len(dead):
        err_console.print(
            f"not {verb}: {plural(len(dead) - done, 'job')} left the dead-letter queue "
            "while this ran",
            highlight=False,
            markup=False,
        )
    if refused or done < len(dead):
        raise SystemExit(1)


@dlq.command("retry")
@app_option
@url_option
@click.argument("job_ids", nargs=-1, type=ID)
@click.option("--all", "take_all", is_flag=True, help="Every dead job (instead of ids).")
def dlq_retry(
    app_spec: str | None, url: str | None, job_ids: tuple[int, ...], take_all: bool
) -> None:
    """Requeue dead jobs, each with a fresh attempt budget.

    The budget is reset, not extended: a retried job's next run is attempt 1 of its
    own max_attempts, and its lease expiries count from 0 again. Its earlier attempts
    stay in its history (`tokenline job ID` says how many), and its fencing token keeps
    increasing. Each id that is not a dead job is named with the reason (no such job,
    or its state) and the exit status is 1; the dead ones among the ids are still
    requeued.
    """
    done, dead, refused = _act_on_dead(
        app_spec, url, job_ids, take_all, lambda s, ids: s.jobs_retry_dead(job_ids=ids)
    )
    _report_dead("requeued", done, dead, refused)


@dlq.command("discard")
@app_option
@url_option
@click.argument("job_ids", nargs=-1, type=ID)
@click.option("--all", "take_all", is_flag=True, help="Every dead job (instead of ids).")
def dlq_discard(
    app_spec: str | None, url: str | None, job_ids: tuple[int, ...], take_all: bool
) -> None:
    """Cancel dead jobs: kept for the record, never run again.

    Each id that is not a dead job is named with the reason (no such job, or its
    state) and the exit status is 1; the dead ones among the ids are still discarded.
    """
    done, dead, refused = _act_on_dead(
        app_spec,
        url,
        job_ids,
        take_all,
        lambda s, ids: s.jobs_cancel(job_ids=ids, reason="discarded from the dead-letter queue"),
    )
    _report_dead("discarded", done, dead, refused)
