"""``tokenline audit``: what the ledger says happened more than once, or was refused.

``tokenline audit duplicates [--since 1h]`` groups by key every execution of an effect
that had already completed (``repeat``), every start of an effect's callee again after
a run of unknown outcome (``rerun``: the effect may have happened twice) and every
write refused for a stale token (``stale``: ledger writes, resource-lease renewals, and
job commits, keyed by the job's idempotency key or ``job:<id>``).
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from .._records import Duplicate, DuplicateKind
from ..stores import Store
from ..stores._repairs import RERUN
from ._common import (
    Col,
    CommandGroup,
    Whole,
    app_option,
    bytes_text,
    console,
    json_option,
    plural,
    print_json,
    reporting_errors,
    resolve_app,
    show,
    url_option,
    when,
    with_store,
)

__all__ = ["audit", "parse_since"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: What --since takes, for its refusals.
_SINCE_FORMS = "give a duration (30m, 2h, 7d), an ISO time or epoch seconds"


def parse_since(value: str, now: float) -> float:
    """Epoch seconds for ``--since``: a duration back from ``now`` (``90s``, ``15m``,
    ``2h``, ``7d``), an ISO 8601 time (UTC unless it says otherwise) or epoch seconds.

    A usage error says why for anything else, and for a time before the epoch (1970):
    nothing was recorded then, and a duration reaching that far is a typo. An empty
    value is refused too, rather than read as no filter at all.
    """
    if not value.strip():
        raise click.BadParameter(f"{value!r} is empty: {_SINCE_FORMS}", param_hint="--since")
    match = _DURATION.match(value)
    try:
        since = now - float(match[1]) * _UNIT[match[2]] if match else float(value)
    except ValueError:
        since = _iso_time(value)
    if since < 0:  # -inf too: a duration of more digits than a float holds
        back = f"{value!r} reaches back" if match else f"{value!r} is"
        raise click.BadParameter(
            f"{back} before the epoch (1970-01-01 UTC), when nothing was recorded",
            param_hint="--since",
        )
    if not math.isfinite(since):
        raise click.BadParameter(f"{value!r} is not a time: {_SINCE_FORMS}", param_hint="--since")
    return since


def _iso_time(value: str) -> float:
    """Epoch seconds of an ISO 8601 time (UTC unless it says otherwise)."""
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: {_SINCE_FORMS}", param_hint="--since") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


@dataclass
class _Group:
    key: str
    repeats: int = 0
    reruns: int = 0
    stale: int = 0
    jobs: set[int] = field(default_factory=set)
    workers: set[str] = field(default_factory=set)
    operations: set[str] = field(default_factory=set)
    first: float = float("inf")
    last: float = 0.0

    def add(self, d: Duplicate) -> None:
        if d.kind is DuplicateKind.REPEAT and d.operation == RERUN:
            self.reruns += 1
        elif d.kind is DuplicateKind.REPEAT:
            self.repeats += 1
        else:
            self.stale += 1
        if d.job_id is not None:
            self.jobs.add(d.job_id)
        self.workers.add(_text(d.owner))
        self.operations.add(_text(d.operation))
        self.first = min(self.first, d.at)
        self.last = max(self.last, d.at)


def _text(value: str) -> str:
    """A stored name as text: bytes (a hand-written row) as :func:`bytes_text` shows
    them, so that groups and their sets still sort, and print, beside the others."""
    return bytes_text(value) if isinstance(value, bytes) else value


def group_by_key(duplicates: Sequence[Duplicate]) -> list[_Group]:
    """One group per key, the most affected first."""
    groups: dict[str, _Group] = {}
    for d in duplicates:
        key = _text(d.key)
        groups.setdefault(key, _Group(key)).add(d)
    # Reruns first: they are where an effect may have happened twice.
    return sorted(groups.values(), key=lambda g: (-g.reruns, -(g.repeats + g.stale), g.key))


def _short(items: set[str] | set[int], limit: int = 3) -> str:
    shown = sorted(str(i) for i in items)
    more = f" +{len(shown) - limit}" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more


@click.group(cls=CommandGroup)
def audit() -> None:
    """Audit the ledger: duplicate executions and refused stale writes."""


@audit.command("duplicates")
@app_option
@url_option
@click.option(
    "--since",
    default=None,
    help="Only since then: a duration back from now (30m, 2h, 7d), an ISO time or epoch.",
)
@click.option(
    "--limit",
    type=Whole(1, 1_000_000),
    default=100_000,
    show_default=True,
    help="Most duplicate records to read, newest first.",
)
@json_option
def duplicates(
    app_spec: str | None, url: str | None, since: str | None, limit: int, as_json: bool
) -> None:
    """Duplicates grouped by key, keys with reruns first, then the most affected.

    A repeat is a run of an effect that had already completed (its callee did not run
    again: the stored result was returned). A rerun is a start of an effect's callee
    again after a run whose outcome is unknown (its attempt lost its lease while the
    callee ran, or the reconciler gave the key up): that run may have had its effect,
    so the effect may have happened twice; check it where it landed. A stale write is
    one the store refused because its token was no longer current.

    --json: {since (epoch seconds, or null), repeats, reruns, stale, keys: a list of
    {key, repeats, reruns, stale, jobs, workers, operations, first, last}} (first and
    last: epoch seconds; jobs, workers and operations: every one, sorted).
    """
    if since is not None:
        # Bad input is refused before the store is opened; a duration is measured
        # again from the store's clock below.
        parse_since(since, time.time())

    async def gather(store: Store) -> tuple[float | None, list[Any]]:
        # "2h" means two hours back by the store's clock, which stamped the records.
        begin = parse_since(since, await store.store_time()) if since is not None else None
        return begin, await store.duplicates_list(since=begin, limit=limit)

    with reporting_errors():
        start, found = with_store(resolve_app(app_spec, url, existing=True), gather)
    groups = group_by_key(found)
    repeats = sum(g.repeats for g in groups)
    reruns = sum(g.reruns for g in groups)
    stale = sum(g.stale for g in groups)
    if as_json:
        print_json(
            {
                "since": start,
                "repeats": repeats,
                "reruns": reruns,
                "stale": stale,
                "keys": [_group_json(g) for g in groups],
            }
        )
        return
    cols = [
        Col("key"),
        Col("repeats", justify="right"),
        Col("reruns", justify="right"),
        Col("stale", justify="right"),
        Col("jobs", "wrap"),
        Col("workers", "wrap"),
        Col("operations", "wrap"),
        Col("first", "wrap", optional=2),
        Col("last", "wrap", optional=1),
    ]
    rows = [
        [
            g.key,
            str(g.repeats),
            str(g.reruns),
            str(g.stale),
            _short(g.jobs),
            _short(g.workers, 2),
            _short(g.operations),
            when(g.first),
            when(g.last),
        ]
        for g in groups
    ]
    show("duplicates by key", cols, rows)
    scope = f" since {when(start)}" if start is not None else ""
    console.print(
        f"{plural(repeats, 'duplicate execution')}, "
        f"{plural(reruns, 'rerun')} after an unknown outcome, "
        f"{plural(stale, 'stale write')} refused, {plural(len(groups), 'key')}{scope}",
        highlight=False,
        markup=False,
    )


def _group_json(g: _Group) -> dict[str, Any]:
    return {
        "key": g.key,
        "repeats": g.repeats,
        "reruns": g.reruns,
        "stale": g.stale,
        "jobs": sorted(g.jobs),
        "workers": sorted(g.workers),
        "operations": sorted(g.operations),
        "first": g.first,
        "last": g.last,
    }
