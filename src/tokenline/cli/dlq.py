"""``tokenline dlq``: list, retry or discard dead jobs."""

from __future__ import annotations

from typing import Any

import click

from .._jobs import JobState
from ..stores import Store
from ._common import (
    app_option,
    console,
    json_option,
    plural,
    print_json,
    reporting_errors,
    resolve_app,
    url_option,
    with_store,
)
from .inspect import LIMIT_HELP, job_json, show_jobs

__all__ = ["dlq"]


@click.group()
def dlq() -> None:
    """Inspect, retry or discard dead jobs."""


@dlq.command("list")
@app_option
@url_option
@click.option("--queue", default=None, help="Only dead jobs of this queue.")
@click.option(
    "--limit",
    type=click.IntRange(1, 10_000),
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
            resolve_app(app_spec, url),
            lambda s: s.jobs_list(state=JobState.DEAD, queue=queue, limit=limit),
        )
    if as_json:
        print_json([job_json(j) for j in items])
    else:
        show_jobs(items, "dead jobs")


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
    """Requeue dead jobs, each with a fresh attempt budget.

    The budget is reset, not extended: a retried job's next run is attempt 1 of its
    own max_attempts, and its lease expiries count from 0 again. Its earlier attempts
    stay in its history, and its fencing token keeps increasing.
    """
    if not job_ids and not take_all:
        raise click.UsageError("give job ids or --all")

    async def run(store: Store) -> int:
        return await store.jobs_retry_dead(job_ids=await _dead_ids(store, job_ids, take_all))

    with reporting_errors():
        n = with_store(resolve_app(app_spec, url), run)
    console.print(f"requeued {plural(n, 'dead job')}", highlight=False)


@dlq.command("discard")
@app_option
@url_option
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--all", "take_all", is_flag=True, help="Every dead job.")
def dlq_discard(
    app_spec: str | None, url: str | None, job_ids: tuple[int, ...], take_all: bool
) -> None:
    """Cancel dead jobs: kept for the record, never run again."""
    if not job_ids and not take_all:
        raise click.UsageError("give job ids or --all")

    async def run(store: Store) -> int:
        ids = await _dead_ids(store, job_ids, take_all)
        dead = [i for i in ids if (await store.job_get(job_id=i)).state is JobState.DEAD]
        return await store.jobs_cancel(job_ids=dead, reason="discarded from the dead-letter queue")

    with reporting_errors():
        n = with_store(resolve_app(app_spec, url), run)
    console.print(f"discarded {plural(n, 'dead job')}", highlight=False)
