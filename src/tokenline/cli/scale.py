"""``tokenline scale-hint``: would adding workers help or hurt, and why."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from .._jobs import JobState, QueueStats, WorkerRecord
from ..health import read_status as _status
from ..scaling import Hint, Snapshot, WorkerLoad, scale_hint
from ..stores import Store
from ..stores.base import Depth, ResourceLease
from ._common import (
    Seconds,
    app_option,
    broker_opener,
    console,
    print_json,
    reporting_errors,
    resolve_app,
    url_option,
)

__all__ = ["BREAKER_PREFIX", "ScaleHinter", "scale_hint_command", "snapshot"]

T = TypeVar("T")

#: Resource leases named so are the open circuit breakers of dependencies.
BREAKER_PREFIX = "tokenline:breaker:"


def _load(w: WorkerRecord) -> WorkerLoad:
    # A limit that came down to 0 is 0, not "unknown": such a worker has no free slot.
    limit = getattr(w, "concurrency_limit", None)
    if limit is None:
        limit = w.concurrency
    return WorkerLoad(state=w.state, in_flight=w.in_flight, limit=limit)


def _backlog(stats: list[QueueStats], depth: list[Depth] | None) -> tuple[int, float | None]:
    """Jobs runnable now in the queues not paused, and the oldest one's age.

    ``depth`` (:meth:`Store.jobs_depth`) counts as ``queued`` every job whose ``run_at``
    has come by the store's clock, whatever its stored state: a delayed job or a retry
    whose time came is stored as scheduled until claimed, and waits for a worker just
    the same (``oldest_ready_age`` already counts it). Without ``depth`` (its read
    failed), the stored queued count stands in.
    """
    paused = {s.queue for s in stats if s.paused}
    ages = [s.oldest_ready_age for s in stats if not s.paused and s.oldest_ready_age is not None]
    if depth is None:
        runnable = sum(s.count(JobState.QUEUED) for s in stats if not s.paused)
    else:
        runnable = sum(
            d.count for d in depth if d.state == JobState.QUEUED.value and d.queue not in paused
        )
    return runnable, max(ages, default=None)


def _open_breakers(leases: list[ResourceLease], now: float) -> list[str]:
    """Dependencies whose open-breaker lease is held, by the store's clock."""
    return sorted(
        lease.resource.removeprefix(BREAKER_PREFIX)
        for lease in leases
        if lease.resource.startswith(BREAKER_PREFIX)
        and not lease.resource.endswith(":probe")
        and lease.expires_at > now
    )


async def _read(call: Callable[[], Awaitable[T]], timeout: float) -> T | Exception:  # noqa: ASYNC109
    """``call()``'s answer within ``timeout``, or the exception it failed with.

    ``call`` is made here, not by the caller: a read cancelled before it starts (a
    Ctrl-C while gather sets its tasks up) must leave no coroutine behind that was never
    awaited, which Python reports on stderr at exit."""
    try:
        # asyncio.timeout, not wait_for: wait_for runs the call in a task of its own,
        # and a call that fails while a Ctrl-C cancels it leaves that task's error
        # unretrieved ("Task exception was never retrieved" at exit).
        async with asyncio.timeout(timeout):
            return await call()
    except Exception as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Cancelled (a Ctrl-C), and the call ended with an error of its own rather
            # than CancelledError: the cancellation must go on, not become an answer.
            raise asyncio.CancelledError from exc
        return exc


async def _depth_and_leases(
    store: Store,
    timeout: float,  # noqa: ASYNC109
) -> tuple[list[Depth] | Exception, list[ResourceLease] | Exception]:
    """The store's job depth (a broker read) and its resource leases (a leases read),
    each within ``timeout``; a read that failed gives its exception instead."""
    # Both reads are the broker's and the leases' (Redis alone on the split topology,
    # which a ledger that is down must not make look failing too).
    opened = await _read(broker_opener(store) or store.open, timeout)
    if isinstance(opened, Exception):
        return opened, opened
    try:
        return await asyncio.gather(
            _read(store.jobs_depth, timeout), _read(store.resource_leases_list, timeout)
        )
    finally:
        await store.close()


async def snapshot(open_store: Any, timeout: float) -> Snapshot:  # noqa: ASYNC109
    """The store as :func:`tokenline.scaling.scale_hint` needs it: channels probed each
    within ``timeout``, backlog, live workers, open breakers. ``open_store()`` gives a
    fresh (unopened) store for each read."""
    report = await _status(open_store(), timeout)
    failing = {
        name: ch["failure"] or "failing"
        for name, ch in report["channels"].items()
        if ch.get("ok") is False
    }
    now = report.get("now")
    if report["store"] != "ok" or now is None:
        return Snapshot(at=0.0, backlog=0, failing_channels=failing or {"broker": "unreachable"})
    if failing:
        # The hint is hold whatever the backlog: no second wait on a channel that
        # just failed to answer.
        backlog, oldest = _backlog(report["queues"] or [], None)
        return Snapshot(
            at=now,
            backlog=backlog,
            oldest_ready_age=oldest,
            workers=[_load(w) for w in report["workers"] or []],
            failing_channels=failing,
        )
    depth, leases = await _depth_and_leases(open_store(), timeout)
    # Both channels answered a moment ago: a read failing now is said, with what failed.
    if isinstance(depth, Exception):
        failing.setdefault("broker", f"failing ({type(depth).__name__})")
    if isinstance(leases, Exception):
        failing.setdefault("leases", f"failing ({type(leases).__name__})")
    backlog, oldest = _backlog(
        report["queues"] or [], None if isinstance(depth, Exception) else depth
    )
    open_deps = [] if isinstance(leases, Exception) else _open_breakers(leases, now)
    return Snapshot(
        at=now,
        backlog=backlog,
        oldest_ready_age=oldest,
        workers=[_load(w) for w in report["workers"]],
        failing_channels=failing,
        open_dependencies=open_deps,
        paused_jobs=_paused_jobs(report["queues"] or []),
    )


def _paused_jobs(stats: list[QueueStats]) -> int:
    """Jobs waiting (queued or scheduled) in paused queues."""
    return sum(s.count(JobState.QUEUED) + s.count(JobState.SCHEDULED) for s in stats if s.paused)


async def hint_for(open_store: Any, *, interval: float, timeout: float) -> Hint:  # noqa: ASYNC109
    """Two snapshots ``interval`` seconds apart, and the hint they give."""
    before = await snapshot(open_store, timeout)
    if before.failing_channels:
        # Hold, whatever a second look would say of the backlog: answered now, not
        # after the interval and another wait on the failing channel.
        return scale_hint(before, before)
    await asyncio.sleep(interval)
    after = await snapshot(open_store, timeout)
    return scale_hint(before, after)


class ScaleHinter:
    """The exporter's ``/scale-hint``: each answer compares the store now with the
    previous look (taken by the previous request, or a second before when that one is
    less than a second old). Thread-safe: requests are answered one at a time."""

    def __init__(self, open_store: Any, *, timeout: float = 5.0, min_interval: float = 1.0) -> None:
        self._open_store = open_store
        self._timeout = timeout
        self._min_interval = min_interval
        self._lock = threading.Lock()
        self._last: tuple[float, Snapshot] | None = None

    def answer(self) -> tuple[int, str, str]:
        """HTTP status, JSON body and its content type."""
        with self._lock:
            hint = asyncio.run(self._hint())
        return 200, json.dumps(hint.json()) + "\n", "application/json"

    async def _hint(self) -> Hint:
        last = self._last
        if last is None or time.monotonic() - last[0] < self._min_interval:
            before = await snapshot(self._open_store, self._timeout)
            if before.failing_channels:
                # Hold at once, as the command does: no second wait on the channel.
                self._last = (time.monotonic(), before)
                return scale_hint(before, before)
            await asyncio.sleep(self._min_interval)
        else:
            before = last[1]
        after = await snapshot(self._open_store, self._timeout)
        self._last = (time.monotonic(), after)
        return scale_hint(before, after)


@click.command("scale-hint")
@app_option
@url_option
@click.option(
    "--interval",
    type=Seconds(0, 3600),
    default=5.0,
    show_default=True,
    help="Seconds between the two looks at the backlog.",
)
@click.option(
    "--timeout",
    type=Seconds(0.1, 600),
    default=5.0,
    show_default=True,
    help="Seconds each channel probe may take.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print {advice, reason, backlog_before, backlog_after, seconds, workers, "
    "workers_fetching, workers_busy, failing_channels, open_dependencies, paused_jobs, ...}.",
)
def scale_hint_command(
    app_spec: str | None, url: str | None, interval: float, timeout: float, as_json: bool
) -> None:
    """Say whether adding workers would help (add), hurt or not help (hold), or is not
    needed (enough), and why.

    Looks at the store twice, INTERVAL seconds apart: a failing or slow channel, an open
    circuit breaker or mostly draining workers mean hold, whatever the backlog; a
    growing backlog with every worker at its limit means add.
    """
    with reporting_errors():
        app = resolve_app(app_spec, url, existing=True, reports_outage=True, timeout=timeout)
        hint = asyncio.run(hint_for(app.open_store, interval=interval, timeout=timeout))
    if as_json:
        print_json(hint.json())
    else:
        console.print(f"{hint.advice.value}: {hint.reason}", highlight=False, markup=False)
