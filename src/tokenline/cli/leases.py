"""Operator commands on ownership: ``leases`` (who holds what, until when), ``lease
release`` (hand a named lease back, fenced by its owner and token) and ``drain`` (ask a
worker to finish its jobs and stop).

Every time shown is judged by the store's clock, as the leases themselves are. A
refusal names what did not match and changes nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import click

from .._errors import InvalidInputError, JobNotFoundError, StaleTokenError
from .._jobs import Job, JobState
from .._records import validate_key
from ..health import alive, lease_mismatch
from ..stores import Store
from ..stores.base import ResourceLease
from ._common import (
    TOKEN,
    Col,
    CommandGroup,
    Whole,
    ago,
    app_option,
    console,
    json_option,
    plural,
    print_json,
    reporting_errors,
    resolve_app,
    show,
    url_option,
    with_store,
)

__all__ = ["drain", "lease", "leases"]


@dataclass(frozen=True, slots=True)
class _JobLease:
    """A running job's lease, and when its attempt claimed the job."""

    job: Job
    claimed_at: float | None


async def _job_leases(store: Store, limit: int) -> list[_JobLease]:
    running = await store.jobs_list(state=JobState.RUNNING, limit=limit, args_limit=0)

    async def claimed_at(job: Job) -> float | None:
        try:
            attempts = await store.job_attempts(job_id=job.id)
        except JobNotFoundError:  # removed since it was listed
            return None
        return next((a.started_at for a in attempts if a.token == job.lease_token), None)

    claims = await asyncio.gather(*(claimed_at(j) for j in running))
    return [_JobLease(j, c) for j, c in zip(running, claims, strict=True)]


def _expiry(expires_at: float | None, now: float) -> str:
    if expires_at is None:
        return "-"
    left = expires_at - now
    return f"in {ago(left)}" if left > 0 else f"expired {ago(-left)} ago"


def _age(since: float | None, now: float) -> str:
    return "-" if since is None else ago(now - since)


def _job_lease_json(jl: _JobLease, now: float) -> dict[str, Any]:
    j = jl.job
    return {
        "job_id": j.id,
        "queue": j.queue,
        "task": j.task,
        "owner": j.lease_owner,
        "token": j.lease_token,
        "expires_at": j.lease_expires_at,
        "expires_in": None if j.lease_expires_at is None else j.lease_expires_at - now,
        "claimed_at": jl.claimed_at,
        "age": None if jl.claimed_at is None else now - jl.claimed_at,
    }


def _resource_lease_json(r: ResourceLease, now: float) -> dict[str, Any]:
    return {
        "key": r.resource,
        "owner": r.owner,
        "token": r.token,
        "held": r.expires_at > now,
        "expires_at": r.expires_at,
        "expires_in": r.expires_at - now,
        "acquired_at": r.acquired_at,
        "age": None if r.acquired_at is None else now - r.acquired_at,
    }


def _show_job_leases(items: list[_JobLease], now: float) -> None:
    cols = [
        Col("job", justify="right"),
        Col("queue"),
        Col("task"),
        Col("owner"),
        Col("token", justify="right"),
        Col("expires", "wrap"),
        Col("age", "wrap", justify="right"),
    ]
    rows = [
        [
            str(jl.job.id),
            jl.job.queue,
            jl.job.task,
            jl.job.lease_owner or "-",
            str(jl.job.lease_token),
            _expiry(jl.job.lease_expires_at, now),
            _age(jl.claimed_at, now),
        ]
        for jl in items
    ]
    show("job leases (running jobs)", cols, rows)


def _show_resource_leases(items: list[ResourceLease], now: float) -> None:
    cols = [
        Col("key"),
        Col("owner"),
        Col("token", justify="right"),
        Col("expires", "wrap"),
        Col("age", "wrap", justify="right"),
    ]
    rows = [
        [r.resource, r.owner, str(r.token), _expiry(r.expires_at, now), _age(r.acquired_at, now)]
        for r in items
    ]
    show("resource leases", cols, rows)


@click.command()
@app_option
@url_option
@click.option("--all", "show_all", is_flag=True, help="Include expired and released leases.")
@click.option(
    "--limit",
    type=Whole(1, 10_000),
    default=1000,
    show_default=True,
    help="Most running jobs to list, newest first.",
)
@json_option
def leases(
    app_spec: str | None, url: str | None, show_all: bool, limit: int, as_json: bool
) -> None:
    """Who holds what: job leases and resource leases, by the store's clock.

    Job leases are the running jobs: each with its queue, task, owner (the worker),
    token, when its lease expires (or how long ago it expired, until the rescue takes
    it) and its age since the claim. Resource leases are the named ones (ctx.lease,
    maintenance leadership): key, owner, token, expiry and age since their token was
    issued; held ones only, unless --all.

    --json: {now (the store's clock), job_leases (job_id, queue, task, owner, token,
    expires_at, expires_in, claimed_at, age), resource_leases (key, owner, token,
    held, expires_at, expires_in, acquired_at, age)}; expires_in is negative once
    expired.
    """

    async def gather(store: Store) -> tuple[float, list[_JobLease], list[ResourceLease]]:
        jobs, named = await _job_leases(store, limit), await store.resource_leases_list()
        # The clock after the rows: read first, it dated them before a slow link had
        # brought them, and showed expiries beyond the TTL.
        return await store.store_time(), jobs, named

    with reporting_errors():
        now, jobs, named = with_store(
            resolve_app(app_spec, url, existing=True, ledger=False), gather, ledger=False
        )
    if not show_all:
        named = [r for r in named if r.expires_at > now]
    if as_json:
        print_json(
            {
                "now": now,
                "job_leases": [_job_lease_json(jl, now) for jl in jobs],
                "resource_leases": [_resource_lease_json(r, now) for r in named],
            }
        )
        return
    _show_job_leases(jobs, now)
    if len(jobs) == limit:
        console.print(
            f"(the newest {plural(limit, 'running job')} only; see --limit)",
            highlight=False,
            markup=False,
        )
    _show_resource_leases(named, now)


# -- lease release --------------------------------------------------------------------------
@click.group(cls=CommandGroup)
def lease() -> None:
    """Act on a named resource lease (see `tokenline leases`)."""


async def _release(store: Store, key: str, owner: str, token: int) -> tuple[bool, float]:
    """Release ``key`` if ``owner`` and ``token`` hold it: (released, how long ago it
    expired when it was no longer held)."""
    found = [r for r in await store.resource_leases_list() if r.resource == key]
    if not found:
        raise InvalidInputError(f"no resource lease named {key!r}: nothing changed")
    (current,) = found
    wrong = lease_mismatch(current, owner, token)
    if wrong is not None:
        raise InvalidInputError(f"lease {key!r} not released: {wrong}; nothing changed")
    now = await store.store_time()
    if current.expires_at <= now:
        return False, now - current.expires_at
    # Fenced in the store: a lease renewed under a new token, or taken over, since it
    # was read above is refused, never released blindly.
    if not await store.resource_lease_release(lease=current):
        raise StaleTokenError(resource=f"lease {key!r}", token=token, operation="release")
    return True, 0.0


@lease.command("release")
@app_option
@url_option
@click.argument("key")
@click.option("--owner", required=True, help="The holder, as `tokenline leases` shows it.")
@click.option(
    "--token", type=TOKEN, required=True, help="The holder's token, as `tokenline leases` shows it."
)
def lease_release(app_spec: str | None, url: str | None, key: str, owner: str, token: int) -> None:
    """Release the resource lease KEY, held by --owner under --token.

    Both must match the current holder, checked by the store itself as it releases:
    a lease taken over, or issued a new token, since you looked is refused, and nothing
    changes. A lease whose holder has already let it expire needs no release. Exit
    status 1 when refused.
    """
    with reporting_errors(unsure="see `tokenline leases`"):
        released, expired_for = with_store(
            # Not Redis alone: the release script checks the token's epoch, which the
            # ledger issues.
            resolve_app(app_spec, url, existing=True),
            lambda s: _release(s, key, owner, token),
        )
    if released:
        text = f"released lease {key!r} (owner {owner!r}, token {token})"
    else:
        text = (
            f"lease {key!r} (owner {owner!r}, token {token}) expired {ago(expired_for)} ago: "
            "nothing to release"
        )
    console.print(text, highlight=False, markup=False)


# -- drain ----------------------------------------------------------------------------------
async def _drain(store: Store, worker_id: str) -> None:
    if await store.worker_drain(worker_id=worker_id):
        return
    # Refused by the store; say why, from what it holds now.
    found = [w for w in await store.workers_list() if w.id == worker_id]
    if not found:
        raise InvalidInputError(
            f"no worker with id {worker_id!r} (see `tokenline workers --all`): nothing changed"
        )
    (w,) = found
    if w.state == "stopped":
        why = "it has stopped"
    elif not alive(w, await store.store_time()):
        why = "its membership has expired (it is gone, or cut off from the store)"
    else:  # live again: it re-registered while this ran
        why = "it re-registered meanwhile; ask again"
    raise InvalidInputError(f"worker {worker_id!r} not asked to drain: {why}; nothing changed")


def _worker_id(_ctx: click.Context | None, _param: click.Parameter | None, value: str) -> str:
    """Callback of ``drain``'s WORKER_ID: the id, checked as a worker checks its own, or
    a usage error saying why it is none. An empty id was looked for in the store, and
    reported as no such worker (exit status 1), as if the store had been asked a
    question that could have another answer."""
    try:
        return validate_key(value, "WORKER_ID")
    except InvalidInputError as exc:
        raise click.BadParameter(f"{exc} (see `tokenline workers` for the ids)") from None


@click.command()
@app_option
@url_option
@click.argument("worker_id", callback=_worker_id)
def drain(app_spec: str | None, url: str | None, worker_id: str) -> None:
    """Ask the live worker WORKER_ID to drain, then stop: as a first SIGTERM does.

    It stops claiming jobs at its next heartbeat, gives those in flight its drain
    timeout to finish, then stops; `tokenline workers` shows it draining meanwhile.
    Exit status 1, with nothing changed, for an unknown worker or one no longer live.
    """
    with reporting_errors(unsure="see `tokenline workers`"):
        with_store(
            resolve_app(app_spec, url, existing=True, ledger=False),
            lambda s: _drain(s, worker_id),
            ledger=False,
        )
    console.print(
        f"asked worker {worker_id!r} to drain: it stops claiming at its next heartbeat, "
        "finishes its jobs within its drain timeout, then stops",
        highlight=False,
        markup=False,
    )
