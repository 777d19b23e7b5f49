"""``tokenline status``: the store's health channel by channel, queues, live workers.

Each channel (DESIGN.md's three roles) is probed on its own, with its own deadline, and
a failing one says how it fails:

* **unreachable**: no connection, or the store said it is unavailable;
* **slow**: no answer within ``--timeout`` (or the store's own statement timeout);
* **refusing**: the store answered, with an error (a missing privilege, say, or a
  PostgreSQL that accepts no writes: a standby, a read-only role);
* **not migrated**: the store answers but its schema is not installed, or is older;
* **schema too new**: the store answers but its schema was written by a newer
  tokenline (upgrade tokenline; migrating cannot help).

When the store cannot even be opened, every channel fails the same way. The probing
lives in :mod:`tokenline.health`, shared with the dashboard; this module prints it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click
from rich.markup import escape

from .._redact import redact
from ..health import CHANNELS, FAILURES, failure_kind
from ..health import read_status as _status
from ._common import (
    Seconds,
    app_option,
    console,
    json_option,
    print_json,
    reporting_errors,
    resolve_app,
    url_option,
    when,
)
from .inspect import queue_json, show_queues, show_workers, stale_json, worker_json

__all__ = ["CHANNELS", "FAILURES", "failure_kind", "status"]


def _dependency_lines(breakers: dict[str, Any], now: float) -> None:
    """One line per dependency: its circuit breaker as the workers share it."""
    for name, b in breakers.items():
        if b["state"] == "open":
            left = b["open_until"] - now
            verdict = f"[bold red]OPEN[/] until {when(b['open_until'])} ({left:.0f}s)"
        elif b["prober"] is not None:
            verdict = f"[yellow]half-open[/], probing: {escape(b['prober'])}"
        elif b["state"] == "half_open":
            verdict = "[yellow]half-open[/], waiting for a trial call"
        else:
            verdict = "[green]closed[/]"
        what = "dependency: its shared circuit breaker"
        console.print(f"{escape(name):<7} {verdict}  [dim]{what}[/]", highlight=False)


def _status_json(url: str, r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "url": url,
        "store": r["store"],
        "error": r["error"],
        "channels": r["channels"],
    }
    # null, never an empty list, where the channel carrying the data failed: a script
    # must not take a failing store for a healthy empty one.
    queues, workers, stale = r["queues"], r["workers"], r["stale_commits"]
    out["queues"] = None if queues is None else [queue_json(s) for s in queues]
    out["workers"] = None if workers is None else [worker_json(w, r["now"]) for w in workers]
    out["stale_commits"] = (
        None if stale is None else {"total": stale[0], "recent": [stale_json(c) for c in stale[1]]}
    )
    if "dependencies" in r:
        out["dependencies"] = r["dependencies"]
    return out


_STORE_LINE = {
    "unreachable": "[bold red]UNREACHABLE[/]",
    "slow": "[bold red]NO ANSWER[/]",
    "refusing": "[green]reachable[/], [bold red]REFUSING[/]",
    "schema not ready": "[green]reachable[/]",
    "missing": "[bold red]NOT FOUND[/]",
}


def _channel_lines(channels: dict[str, Any], *, errors: bool) -> None:
    """One line per channel: ok with its latency, or how it fails (and why, with
    ``errors``: when the store as a whole failed, its error is said once, above)."""
    for name, what in CHANNELS.items():
        p = channels[name]
        if p["ok"] is None:
            verdict = "-      not provided by this store"
        elif p["ok"]:
            verdict = f"[green]ok[/]  {p['latency_ms']:7.1f} ms"
        else:
            why = f": {escape(p['error'])}" if errors else ""
            verdict = f"[bold red]FAILING[/]  {p['failure']}{why}"
        console.print(f"{name:<7} {verdict}  [dim]{escape(what)}[/]", highlight=False)


def _unknown(what: str, channel: str) -> None:
    """Say that ``what`` is unknown, not empty: the channel carrying it failed."""
    console.print(
        f"{what}: [bold red]UNKNOWN[/] (the {channel} channel is failing)", highlight=False
    )


def _status_text(url: str, r: dict[str, Any]) -> None:
    if r["store"] != "ok":
        console.print(f"store   {_STORE_LINE[r['store']]}  {escape(url)}", highlight=False)
        if r["store"] == "schema not ready":
            console.print("schema  [bold red]NOT READY[/]", highlight=False)
        console.print(f"  {r['error']}", highlight=False, markup=False)
        _channel_lines(r["channels"], errors=False)
        return
    console.print(f"store   [green]reachable[/]  {escape(url)}", highlight=False)
    _channel_lines(r["channels"], errors=True)
    if "dependencies" in r:
        if r["dependencies"] is None:
            _unknown("dependencies", "leases")
        else:
            _dependency_lines(r["dependencies"], r["now"])
    if r["queues"] is None:
        _unknown("queues", "broker")
    else:
        show_queues(r["queues"])
    if r["workers"] is None:
        _unknown("workers", "leases")
    else:
        show_workers(r["workers"], r["now"])
    if r["stale_commits"] is None:
        _unknown("stale commits", "broker")
    else:
        total, recent = r["stale_commits"]
        console.print(f"stale commits refused by the store: {total}", highlight=False)
        for c in recent:
            console.print(
                f"  job {c.job_id} token {c.token} {c.operation} by {c.owner} at {when(c.at)}",
                highlight=False,
                markup=False,
            )


@click.command()
@app_option
@url_option
@click.option(
    "--timeout",
    type=Seconds(0.1, 600),
    default=5.0,
    show_default=True,
    help="Longest each channel (and opening the store) may take, seconds; longer is slow.",
)
@json_option
def status(app_spec: str | None, url: str | None, timeout: float, as_json: bool) -> None:
    """Store health by channel, queues and live workers.

    The store carries three channels, probed at once, each on its own and within
    --timeout: broker (the queue: enqueue, claim, finish), leases (job ownership: lease
    renewal, worker membership, the store's clock) and ledger (effects and fenced
    writes). A failing channel says how: unreachable (no connection, or the store says
    it is unavailable), slow (no answer in time), refusing (the store answered with an
    error, such as a missing privilege, or a PostgreSQL that accepts no writes: the
    broker's check asks), not migrated (its schema is not installed,
    or is older: run `tokenline migrate`) or schema too new (its schema was written
    by a newer tokenline: upgrade tokenline). When the store cannot be opened every
    channel fails that way; a SQLite file that does not exist is said so. Exit status
    1 when the store or a channel is not ok.

    --json keys: url; store ("ok", "unreachable", "slow", "refusing", "schema not
    ready" or "missing"); error; channels (broker, leases, ledger, each with ok,
    failure (null, "unreachable", "slow", "refusing", "not migrated" or "schema too
    new"), latency_ms,
    error; ok is null for a channel the store does not provide); queues (as in `queues
    --json`), workers (live ones, as in `workers --json`), stale_commits (total,
    recent: job_id, token, owner, operation, at); and when the --app registers
    dependencies, dependencies (each: state "closed", "open" or "half_open",
    open_until, prober), one line each in the text output. queues and stale_commits
    are null when the broker channel fails, workers and dependencies when the leases
    channel does (all of them when the store cannot be opened): unknown, not empty.
    """
    with reporting_errors():
        app = resolve_app(app_spec, url, migrate=False)
        report = asyncio.run(_status(app.open_store(), timeout, tuple(app.dependencies)))
    if as_json:
        print_json(_status_json(redact(app.url), report))
    else:
        _status_text(redact(app.url), report)
    channels = report["channels"]
    if report["store"] != "ok" or any(c["ok"] is False for c in channels.values()):
        raise SystemExit(1)
