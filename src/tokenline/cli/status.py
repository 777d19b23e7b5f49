"""``tokenline status``: the store's health channel by channel, queues, live workers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import click
from rich.markup import escape

from .._errors import SchemaVersionError, StoreError, StoreUnavailableError
from ..stores import Store
from ._common import (
    app_option,
    console,
    json_option,
    print_json,
    reporting_errors,
    resolve_app,
    url_option,
    when,
)
from .inspect import live, queue_json, show_queues, show_workers, stale_json, worker_json

__all__ = ["CHANNELS", "status"]

#: What each channel of the store carries (DESIGN.md's three roles).
CHANNELS = {
    "broker": "the queue: enqueue, claim, finish",
    "leases": "job ownership: lease renewal, workers, the store's clock",
    "ledger": "effects and fenced writes",
}


class _Probe:
    """One channel's answer: how long it took, and its error if it failed."""

    def __init__(self) -> None:
        self.latency: float | None = None
        self.error: str | None = None

    async def run(self, call: Callable[[], Awaitable[Any]]) -> Any:
        started = time.monotonic()
        try:
            return await call()
        except StoreError as exc:
            self.error = str(exc)
            return None
        finally:
            self.latency = time.monotonic() - started

    def json(self) -> dict[str, Any]:
        return {
            "ok": self.error is None,
            "latency_ms": None if self.latency is None else round(self.latency * 1000, 3),
            "error": self.error,
        }


def _missing_sqlite_file(store: Store) -> str | None:
    """The path of a SQLite store's file when it does not exist (opening would create
    it, and an empty store at a mistyped path would look healthy)."""
    from ..stores.sqlite import SQLiteStore

    if isinstance(store, SQLiteStore) and not store.path.exists():
        return str(store.path)
    return None


async def _status(store: Store) -> dict[str, Any]:
    """Open ``store`` and ask each channel in turn; what failed is said, not raised."""
    report: dict[str, Any] = {"store": "ok", "error": None}
    missing = _missing_sqlite_file(store)
    if missing is not None:
        report.update(
            store="missing",
            error=f"there is no store file at {missing!r}: check the URL (a worker, an "
            "enqueue or `tokenline migrate` creates it)",
        )
        return report
    try:
        await store.open()
    except SchemaVersionError as exc:
        report.update(store="schema not ready", error=str(exc))
        return report
    except StoreUnavailableError as exc:
        report.update(store="unreachable", error=str(exc))
        return report
    except StoreError as exc:
        report.update(store="failed", error=str(exc))
        return report
    try:
        probes = {name: _Probe() for name in CHANNELS}
        report["queues"] = await probes["broker"].run(store.queues_stats) or []
        stale = await probes["broker"].run(lambda: store.stale_commits(limit=5))
        now = await probes["leases"].run(store.store_time)
        records = await probes["leases"].run(store.workers_list) or []
        if store.capabilities.ledger:
            await probes["ledger"].run(lambda: store.duplicates_list(limit=1))
    finally:
        await store.close()
    report["channels"] = {name: p.json() for name, p in probes.items()}
    if not store.capabilities.ledger:
        report["channels"]["ledger"] = {"ok": None, "latency_ms": None, "error": None}
    report["now"] = now
    report["workers"] = live(records, now) if now is not None else []
    report["stale_commits"] = stale
    return report


def _status_json(url: str, r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"url": url, "store": r["store"], "error": r["error"]}
    if "channels" in r:
        total, recent = r["stale_commits"] or (None, [])
        out.update(
            channels=r["channels"],
            queues=[queue_json(s) for s in r["queues"]],
            workers=[worker_json(w, r["now"]) for w in r["workers"]],
            stale_commits={"total": total, "recent": [stale_json(c) for c in recent]},
        )
    return out


_STORE_LINE = {
    "unreachable": "[bold red]UNREACHABLE[/]",
    "schema not ready": "[green]reachable[/]",
    "missing": "[bold red]NOT FOUND[/]",
    "failed": "[bold red]FAILED[/]",
}


def _status_text(url: str, r: dict[str, Any]) -> None:
    if r["store"] != "ok":
        console.print(f"store   {_STORE_LINE[r['store']]}  {escape(url)}", highlight=False)
        if r["store"] == "schema not ready":
            console.print("schema  [bold red]NOT READY[/]", highlight=False)
        console.print(f"  {r['error']}", highlight=False, markup=False)
        return
    console.print(f"store   [green]reachable[/]  {escape(url)}", highlight=False)
    for name, what in CHANNELS.items():
        p = r["channels"][name]
        if p["ok"] is None:
            verdict = "-      not provided by this store"
        elif p["ok"]:
            verdict = f"[green]ok[/]  {p['latency_ms']:7.1f} ms"
        else:
            verdict = f"[bold red]FAILING[/]  {escape(p['error'])}"
        console.print(f"{name:<7} {verdict}  [dim]{escape(what)}[/]", highlight=False)
    show_queues(r["queues"])
    if r["now"] is not None:
        show_workers(r["workers"], r["now"])
    if r["stale_commits"] is not None:
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
@json_option
def status(app_spec: str | None, url: str | None, as_json: bool) -> None:
    """Store health by channel, queues and live workers.

    The store carries three channels, each probed on its own: broker (the queue:
    enqueue, claim, finish), leases (job ownership: lease renewal, worker membership,
    the store's clock) and ledger (effects and fenced writes). A store that answers but
    whose schema is not installed, or a SQLite file that does not exist, is said so.
    Exit status 1 when the store or a channel is not ok.

    --json keys: url; store ("ok", "unreachable", "schema not ready", "missing" or
    "failed"); error; and, once the store answered: channels (broker, leases, ledger,
    each with ok, latency_ms, error; ok is null for a channel the store does not
    provide), queues (as in `queues --json`), workers (live ones, as in `workers
    --json`), stale_commits (total, recent: job_id, token, owner, operation, at).
    """
    with reporting_errors():
        app = resolve_app(app_spec, url)
        report = asyncio.run(_status(app.open_store()))
    if as_json:
        print_json(_status_json(app.url, report))
    else:
        _status_text(app.url, report)
    channels = report.get("channels", {})
    if report["store"] != "ok" or any(c["ok"] is False for c in channels.values()):
        raise SystemExit(1)
