"""``tokenline status``: the store's health channel by channel, queues, live workers.

Each channel (DESIGN.md's three roles) is probed on its own, with its own deadline, and
a failing one says how it fails:

* **unreachable**: no connection, or the store said it is unavailable;
* **slow**: no answer within ``--timeout`` (or the store's own statement timeout);
* **refusing**: the store answered, with an error (a missing privilege, say);
* **not migrated**: the store answers but its schema is not installed, or is older.

When the store cannot even be opened, every channel fails the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import click
from rich.markup import escape

from .._errors import SchemaVersionError, StoreError, StoreUnavailableError
from ..dependencies import SharedBreaker, read_shared
from ..drill.storefaults import InjectedFaultError
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

__all__ = ["CHANNELS", "FAILURES", "failure_kind", "status"]

T = TypeVar("T")

#: What each channel of the store carries (DESIGN.md's three roles).
CHANNELS = {
    "broker": "the queue: enqueue, claim, finish",
    "leases": "job ownership: lease renewal, workers, the store's clock",
    "ledger": "effects and fenced writes",
}

UNREACHABLE, SLOW, REFUSING, NOT_MIGRATED = "unreachable", "slow", "refusing", "not migrated"
#: The ways a channel fails, as status names them.
FAILURES = (UNREACHABLE, SLOW, REFUSING, NOT_MIGRATED)

#: How long a probe given up on may take to end before status goes on without it.
_GRACE = 1.0

# The drivers' own codes, read from the cause the store kept when it translated the
# error: the exception tree says "unavailable" for both a refused connection and a
# missing privilege, which an operator fixes in different places.
_SLOW_SQLSTATES = frozenset({"57014"})  # query_canceled: statement_timeout
_REFUSED_SQLSTATES = frozenset({"42501", "28000", "28P01"})  # privilege, authorisation
_UNMIGRATED_SQLSTATES = frozenset({"3F000", "42P01", "42883"})  # no schema, table, function
_REFUSED_SQLITE = frozenset({sqlite3.SQLITE_PERM, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_AUTH})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from, innermost last."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _cause_kind(exc: BaseException) -> str | None:
    sqlstate = getattr(exc, "sqlstate", None)
    code = getattr(exc, "sqlite_errorcode", None)
    hung = isinstance(exc, InjectedFaultError) and exc.kind == "hang"
    if hung or isinstance(exc, TimeoutError) or sqlstate in _SLOW_SQLSTATES:
        return SLOW
    if sqlstate in _UNMIGRATED_SQLSTATES:
        return NOT_MIGRATED
    if isinstance(exc, PermissionError) or sqlstate in _REFUSED_SQLSTATES:
        return REFUSING
    if isinstance(code, int) and code & 0xFF in _REFUSED_SQLITE:
        return REFUSING
    return None


def failure_kind(exc: BaseException) -> str:
    """How a store call failed, one of :data:`FAILURES`."""
    if isinstance(exc, SchemaVersionError):
        return NOT_MIGRATED
    for e in _chain(exc):
        kind = _cause_kind(e)
        if kind is not None:
            return kind
    return UNREACHABLE if isinstance(exc, StoreUnavailableError) else REFUSING


async def _bounded(coro: Coroutine[Any, Any, T], timeout: float) -> T:  # noqa: ASYNC109
    """``coro``'s result, or :class:`TimeoutError` after ``timeout`` seconds; a call
    given up on gets a moment to end, never as long as it likes."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=_GRACE)
        raise TimeoutError(f"no answer within {timeout:g}s")
    return task.result()


class _Probe:
    """One channel's answer: how long it took, and how it failed if it did."""

    def __init__(self) -> None:
        self.latency: float | None = None
        self.failure: str | None = None
        self.error: str | None = None

    def failed(self, exc: BaseException) -> None:
        self.failure = failure_kind(exc)
        self.error = str(exc) or type(exc).__name__

    async def run(self, call: Callable[[], Coroutine[Any, Any, T]], timeout: float) -> T | None:  # noqa: ASYNC109
        started = time.monotonic()
        try:
            return await _bounded(call(), timeout)
        except (StoreError, TimeoutError) as exc:
            self.failed(exc)
            return None
        finally:
            self.latency = time.monotonic() - started

    def json(self) -> dict[str, Any]:
        return {
            "ok": self.error is None,
            "failure": self.failure,
            "latency_ms": None if self.latency is None else round(self.latency * 1000, 3),
            "error": self.error,
        }


def _missing_sqlite_file(store: Store) -> str | None:
    """The path of a SQLite store's file when it does not exist in a directory that
    does (opening would create it, and an empty store at a mistyped path would look
    healthy). A missing directory is left to ``open``: the store is unreachable."""
    from ..stores.sqlite import SQLiteStore

    inner = getattr(store, "inner", store)  # a store wrapped for faults
    if isinstance(inner, SQLiteStore) and inner.path.parent.is_dir() and not inner.path.exists():
        return str(inner.path)
    return None


#: The store's verdict when opening it failed in this way.
_STORE_STATE = {
    UNREACHABLE: "unreachable",
    SLOW: "slow",
    REFUSING: "refusing",
    NOT_MIGRATED: "schema not ready",
}


#: The ledger channel of a store without one.
_NOT_PROVIDED: dict[str, Any] = {"ok": None, "failure": None, "latency_ms": None, "error": None}


def _all_failing(store: Store, kind: str, error: str) -> dict[str, Any]:
    """Every channel failing as the store did."""
    failing = {"ok": False, "failure": kind, "latency_ms": None, "error": error}
    channels = {name: dict(failing) for name in CHANNELS}
    if not store.capabilities.ledger:
        channels["ledger"] = dict(_NOT_PROVIDED)
    return channels


async def _open(store: Store, timeout: float) -> dict[str, Any] | None:  # noqa: ASYNC109
    """Open ``store``; ``None`` when it opened, else the report of how it failed."""
    missing = _missing_sqlite_file(store)
    if missing is not None:
        error = (
            f"there is no store file at {missing!r}: check the URL (a worker, an enqueue "
            "or `tokenline migrate` creates it)"
        )
        return {
            "store": "missing",
            "error": error,
            "channels": _all_failing(store, NOT_MIGRATED, error),
        }
    by_role = getattr(getattr(store, "inner", store), "open_within", None)
    if by_role is not None:
        # A store whose roles live on different servers (the split topology) opens
        # each on its own: the roles that failed are said, the others probed.
        await by_role(timeout)
        return None
    try:
        await _bounded(store.open(), timeout)
    except (StoreError, TimeoutError) as exc:
        kind = failure_kind(exc)
        error = str(exc) or type(exc).__name__
        return {
            "store": _STORE_STATE[kind],
            "error": error,
            "channels": _all_failing(store, kind, error),
        }
    return None


def _roles_down(store: Store) -> dict[str, Exception]:
    """The roles a split store could not open (kept by its last open), else none."""
    failed = getattr(getattr(store, "inner", store), "roles_down", None)
    return dict(failed) if isinstance(failed, dict) else {}


def _name_servers(store: Store, channels: dict[str, Any]) -> None:
    """On a store whose roles live on different servers, make each failing channel's
    error name its server (Redis or PostgreSQL) when it does not already."""
    server = getattr(getattr(store, "inner", store), "server", None)
    if server is None:
        return
    for name, channel in channels.items():
        error = channel.get("error")
        if channel.get("ok") is False and error:
            where = str(server(name))
            if where.split(" ")[0] not in error:
                channel["error"] = f"{error} ({where})"


async def _close(store: Store, timeout: float) -> None:  # noqa: ASYNC109
    # Best effort: what status had to say is said; a store that will not close is not news.
    with contextlib.suppress(StoreError, TimeoutError):
        await _bounded(store.close(), timeout)


async def _status(
    store: Store,
    timeout: float,  # noqa: ASYNC109
    dependencies: Sequence[str] = (),
) -> dict[str, Any]:
    """Open ``store`` and probe its channels at once, each within ``timeout`` seconds;
    what failed, and how, is said, not raised. ``dependencies``: names whose shared
    circuit breakers to read with the leases channel."""
    failed = await _open(store, timeout)
    if failed is not None:
        return failed
    down = _roles_down(store)
    probes = {name: _Probe() for name in CHANNELS}

    async def broker() -> tuple[Any, Any]:
        return await store.queues_stats(), await store.stale_commits(limit=5)

    async def leases() -> tuple[float, Any, Any]:
        named = await store.resource_leases_list() if dependencies else []
        return await store.store_time(), await store.workers_list(), named

    async def ledger() -> None:
        if store.capabilities.ledger:
            # A split store's own ledger: its audit merges Redis's refusals, which
            # would make a Redis outage look like a ledger one.
            ledger_store = getattr(store, "ledger", None)
            target = ledger_store if isinstance(ledger_store, Store) else store
            await target.duplicates_list(limit=1)

    try:
        queues, membership, _ = await asyncio.gather(
            probes["broker"].run(broker, timeout),
            probes["leases"].run(leases, timeout),
            probes["ledger"].run(ledger, timeout),
        )
    finally:
        await _close(store, timeout)
    report: dict[str, Any] = {"store": "ok", "error": None}
    report["channels"] = {name: p.json() for name, p in probes.items()}
    for name, exc in down.items():
        report["channels"][name] = {
            "ok": False,
            "failure": failure_kind(exc),
            "latency_ms": None,
            "error": str(exc) or type(exc).__name__,
        }
    _name_servers(store, report["channels"])
    if not store.capabilities.ledger:
        report["channels"]["ledger"] = dict(_NOT_PROVIDED)
    stats, stale = queues or ([], None)
    now, records, named = membership or (None, [], [])
    report["queues"] = stats
    report["now"] = now
    if dependencies and now is not None:
        shared = read_shared(named, now)
        report["dependencies"] = {
            name: {"state": "closed", "open_until": None, "prober": None}
            | ({} if (b := shared.get(name)) is None else _breaker_json(b))
            for name in dependencies
        }
    report["workers"] = live(records, now) if now is not None else []
    report["stale_commits"] = stale
    return report


def _breaker_json(b: SharedBreaker) -> dict[str, Any]:
    return {"state": b.state.value, "open_until": b.open_until, "prober": b.prober}


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
    if r["store"] == "ok":
        total, recent = r["stale_commits"] or (None, [])
        out.update(
            queues=[queue_json(s) for s in r["queues"]],
            workers=[worker_json(w, r["now"]) for w in r["workers"]],
            stale_commits={"total": total, "recent": [stale_json(c) for c in recent]},
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
        _dependency_lines(r["dependencies"], r["now"])
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
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
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
    error, such as a missing privilege) or not migrated (its schema is not installed,
    or is older). When the store cannot be opened every channel fails that way; a
    SQLite file that does not exist is said so. Exit status 1 when the store or a
    channel is not ok.

    --json keys: url; store ("ok", "unreachable", "slow", "refusing", "schema not
    ready" or "missing"); error; channels (broker, leases, ledger, each with ok,
    failure (null, "unreachable", "slow", "refusing" or "not migrated"), latency_ms,
    error; ok is null for a channel the store does not provide); and, once the store
    opened: queues (as in `queues --json`), workers (live ones, as in `workers
    --json`), stale_commits (total, recent: job_id, token, owner, operation, at);
    and when the --app registers dependencies, dependencies (each: state "closed",
    "open" or "half_open", open_until, prober), one line each in the text output.
    """
    with reporting_errors():
        app = resolve_app(app_spec, url)
        report = asyncio.run(_status(app.open_store(), timeout, tuple(app.dependencies)))
    if as_json:
        print_json(_status_json(app.url, report))
    else:
        _status_text(app.url, report)
    channels = report["channels"]
    if report["store"] != "ok" or any(c["ok"] is False for c in channels.values()):
        raise SystemExit(1)
