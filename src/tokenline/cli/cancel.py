"""``tokenline cancel``: cancel jobs that have not run yet, naming each id it did not."""

from __future__ import annotations

import click

from .._app import cancel_input
from .._errors import InvalidInputError, JobNotFoundError, TokenlineError
from .._jobs import Job, JobState
from ..stores import Store
from ._common import (
    ID,
    ago,
    app_option,
    console,
    err_console,
    plural,
    reporting_errors,
    resolve_app,
    url_option,
    with_store,
)

__all__ = ["cancel"]

#: Why a job in each state is not cancelled.
_NOT_CANCELLED = {
    JobState.RUNNING: "it is running: its attempt finishes as it would (cancel it if it "
    "is queued again)",
    JobState.SUCCEEDED: "it has succeeded",
    JobState.CANCELLED: "it is already cancelled",
}
#: The states a cancel acts on.
_CANCELLABLE = (JobState.QUEUED, JobState.SCHEDULED, JobState.DEAD)


async def _not_cancelled(store: Store, job: Job) -> str:
    """Why ``job`` (in a state a cancel does not act on) is not cancelled."""
    if job.state is JobState.RUNNING and job.lease_expires_at is not None:
        # A running job whose lease ran out has no attempt left to finish (its worker
        # was killed or cut off): waiting for one, as the usual reason says, waits for
        # nothing. The rescue is what moves it, so that is what the operator is told.
        left = job.lease_expires_at - await store.store_time()
        if left <= 0:
            return (
                f"it is running, but its lease expired {ago(-left)} ago by the store's "
                "clock (its worker is gone): no attempt will finish; the maintenance "
                "leader's rescue queues it again (or dead-letters it past its "
                "max_lease_expiries), and it can be cancelled then"
            )
    return _NOT_CANCELLED.get(job.state, f"its state is {job.state.value}")


async def _cancel(
    store: Store,
    job_ids: tuple[int, ...],
    reason: str,
    done: list[int],
    refused: list[tuple[int, str]],
) -> None:
    """Cancel each job of ``job_ids`` that may be, adding its id to ``done``, and each
    other to ``refused`` with the reason (one at a time, so that each is said for what
    it was). Filled as it goes: a store that fails part way leaves what was done."""
    for jid in dict.fromkeys(job_ids):  # each id once, in the order given
        try:
            job = await store.job_get(job_id=jid)
        except JobNotFoundError:
            refused.append((jid, "no such job"))
            continue
        if job.state not in _CANCELLABLE:
            refused.append((jid, await _not_cancelled(store, job)))
        elif await store.jobs_cancel(job_ids=[jid], reason=reason):
            done.append(jid)
        else:
            refused.append((jid, "it started meanwhile"))


def _say(done: list[int], refused: list[tuple[int, str]]) -> None:
    """Print the ids cancelled (on stdout) and each other one with why (on stderr)."""
    ids = f": {', '.join(map(str, done))}" if done else ""
    console.print(f"cancelled {plural(len(done), 'job')}{ids}", highlight=False)
    for jid, why in refused:
        err_console.print(f"not cancelled: job {jid}: {why}", highlight=False, markup=False)


@click.command()
@app_option
@url_option
@click.argument("job_ids", nargs=-1, type=ID, required=True)
@click.option(
    "--reason",
    default="cancelled by an operator",
    show_default=True,
    help="Kept as the jobs' last error.",
)
def cancel(app_spec: str | None, url: str | None, job_ids: tuple[int, ...], reason: str) -> None:
    """Cancel jobs that have not run yet (queued or scheduled), or are dead: they never
    run (again). A running job finishes its attempt; each id not cancelled is named,
    with why, and the exit status is then 1."""
    try:
        # The API's checks: the same limit, NULs and lone surrogates escaped.
        _, reason = cancel_input(job_ids, reason)
    except InvalidInputError as exc:
        raise click.BadParameter(str(exc), param_hint="'--reason'") from None
    done: list[int] = []
    refused: list[tuple[int, str]] = []
    with reporting_errors(unsure="see `tokenline job ID` for each id"):
        try:
            with_store(
                resolve_app(app_spec, url, existing=True, ledger=False),
                lambda s: _cancel(s, job_ids, reason, done, refused),
                ledger=False,
            )
        except TokenlineError:
            # The ids handled before the store failed are said first: the error, and
            # what it says of the change it failed on, is about the next one only.
            if done or refused:
                _say(done, refused)
            raise
    _say(done, refused)
    if refused:
        raise SystemExit(1)
