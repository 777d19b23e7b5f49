"""What the dashboard shows, read from the store: no HTTP, no HTML.

Each read opens a fresh store and closes it, as the command line does, so a store
that went away is seen at the next refresh and never holds the web server up. The
channel health, worker liveness and the scale hint are the ones ``tokenline status``,
``tokenline workers`` and ``tokenline scale-hint`` print: this module only gathers
them for a page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._app import App
from .._errors import StoreError
from .._jobs import JobState, QueueStats, WorkerRecord
from ..health import alive, read_status
from ..stores import Store

__all__ = [
    "WORKER_STATES",
    "Alert",
    "Overview",
    "QueueRow",
    "WorkerRow",
    "firing_alerts",
    "opened",
    "queue_row",
    "read_drill_results",
    "read_overview",
]

#: Worker states in the order the overview groups them (DESIGN.md section 5).
WORKER_STATES = ("ready", "processing", "draining", "fenced", "stopped")

#: The age of the oldest ready job past which TokenlineJobAgeOverSLA fires (seconds).
JOB_AGE_SLA = 300.0
#: The clock skew past which TokenlineClockSkewPastLeaseMargin fires (seconds).
SKEW_LIMIT = 3.0
#: How far back a recorded duplicate counts as "processed twice, lately" (seconds).
DUPLICATE_WINDOW = 600.0


@contextlib.asynccontextmanager
async def opened(app: App) -> AsyncIterator[Store]:
    """A fresh store of ``app``, open for the ``async with`` block."""
    store = app.open_store()
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@dataclass(frozen=True, slots=True)
class QueueRow:
    """A queue as the overview lists it."""

    name: str
    queued: int
    scheduled: int
    running: int
    dead: int
    succeeded: int
    oldest_ready_age: float | None
    paused: bool


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """A worker's membership, judged by the store's clock."""

    record: WorkerRecord
    alive: bool
    heartbeat_gap: float

    @property
    def group(self) -> str:
        """The state it is listed under; a membership lost unstopped keeps its last
        state (and says it is lost)."""
        return self.record.state if self.record.state in WORKER_STATES else "ready"


@dataclass(frozen=True, slots=True)
class Alert:
    """An alert rule of ``ops/alerts.rules.yml`` whose condition holds right now."""

    name: str
    subject: str
    detail: str


@dataclass(slots=True)
class Overview:
    """The overview page's data, one read of the store."""

    store: str
    error: str | None
    channels: dict[str, Any]
    dependencies: dict[str, Any] = field(default_factory=dict)
    now: float | None = None
    queues: list[QueueRow] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)
    stale_total: int | None = None
    recent_duplicates: int = 0
    alerts: list[Alert] = field(default_factory=list)

    def workers_by_state(self) -> dict[str, list[WorkerRow]]:
        """Workers under each of :data:`WORKER_STATES`, in that order."""
        groups: dict[str, list[WorkerRow]] = {s: [] for s in WORKER_STATES}
        for w in self.workers:
            groups[w.group].append(w)
        return groups

    def verdict(self) -> tuple[str, str, list[str]]:
        """The answer to "compute or coordination?": a level ("ok", "warn" or "bad"),
        a headline (from the gravest finding) and every finding, gravest first: the
        store or a channel failing, a dependency's breaker open, workers fenced or
        draining, paused queues, dead letters, alert conditions."""
        if self.store != "ok":
            return "bad", f"Store {self.store}", [self.error or ""]
        bad: list[tuple[str, str]] = []
        failing = [n for n, c in self.channels.items() if c["ok"] is False]
        if failing:
            bad.append(("Coordination problem", f"failing channel: {', '.join(failing)}"))
        tripped = [n for n, b in self.dependencies.items() if b["state"] == "open"]
        if tripped:
            bad.append(("Dependency down", f"circuit breaker open: {', '.join(tripped)}"))
        groups = self.workers_by_state()
        for state in ("fenced", "draining"):
            ids = [w.record.id for w in groups[state] if w.alive]
            if ids:
                bad.append(("Coordination problem", f"{state}: {', '.join(ids)}"))
        notes = [f"queue paused: {q.name}" for q in self.queues if q.paused]
        notes += [f"dead letters: {q.dead} in {q.name}" for q in self.queues if q.dead]
        notes += [f"{a.name}: {a.subject}" for a in self.alerts]
        if bad:
            findings = [why for _, why in bad] + notes
            return "bad", bad[0][0], [*findings, "Adding workers will not help."]
        if notes:
            return "warn", "Attention", notes
        return "ok", "All channels healthy", ["Any backlog is a question of compute."]

    @property
    def healthy(self) -> bool:
        """Whether the store and every channel it provides answer."""
        return self.store == "ok" and all(c["ok"] is not False for c in self.channels.values())


def queue_row(s: QueueStats) -> QueueRow:
    """A queue's counts as the pages show them."""
    return QueueRow(
        name=s.queue,
        queued=s.count(JobState.QUEUED),
        scheduled=s.count(JobState.SCHEDULED),
        running=s.count(JobState.RUNNING),
        dead=s.count(JobState.DEAD),
        succeeded=s.count(JobState.SUCCEEDED),
        oldest_ready_age=s.oldest_ready_age,
        paused=s.paused,
    )


def firing_alerts(o: Overview) -> list[Alert]:
    """The alert conditions that hold in ``o``, judged on this one read (the rules' own
    ``for:`` windows need Prometheus' history, which the dashboard does not keep)."""
    found: list[Alert] = []
    if o.store != "ok":
        found.append(Alert("TokenlineStoreUnreadable", "store", o.error or o.store))
        return found
    fetching = [w for w in o.workers if w.alive and w.record.state in ("ready", "processing")]
    for q in o.queues:
        if q.queued and not q.paused and not any(q.name in w.record.queues for w in fetching):
            found.append(
                Alert(
                    "TokenlineJobsQueuedWithoutWorkers",
                    q.name,
                    f"{q.queued} queued, no live worker fetching it",
                )
            )
        if q.oldest_ready_age is not None and q.oldest_ready_age > JOB_AGE_SLA:
            found.append(
                Alert(
                    "TokenlineJobAgeOverSLA",
                    q.name,
                    f"oldest ready job waits {q.oldest_ready_age:.0f}s (> {JOB_AGE_SLA:.0f}s)",
                )
            )
    for w in o.workers:
        skew = w.record.clock_skew
        if w.alive and skew is not None and abs(skew) > SKEW_LIMIT:
            found.append(
                Alert("TokenlineClockSkewPastLeaseMargin", w.record.id, f"clock skew {skew:+.1f}s")
            )
    if o.recent_duplicates:
        found.append(
            Alert(
                "TokenlineResourceProcessedTwice",
                "ledger",
                f"{o.recent_duplicates} duplicate(s) recorded in the last "
                f"{DUPLICATE_WINDOW / 60:.0f} minutes",
            )
        )
    return found


async def _memberships(app: App, now: float) -> tuple[list[WorkerRecord], int]:
    """Every worker row, and how many duplicates were recorded lately."""
    async with opened(app) as store:
        records = await store.workers_list()
        dups = 0
        if store.capabilities.ledger:
            dups = len(await store.duplicates_list(since=now - DUPLICATE_WINDOW, limit=1000))
        return records, dups


async def read_overview(app: App, timeout: float) -> Overview:  # noqa: ASYNC109
    """Channels (each probed within ``timeout`` seconds), breakers, queues, every worker
    membership and the alert conditions, as ``tokenline status`` reads them."""
    report = await read_status(app.open_store(), timeout, tuple(app.dependencies))
    o = Overview(store=report["store"], error=report["error"], channels=report["channels"])
    if report["store"] != "ok" or report.get("now") is None:
        o.alerts = firing_alerts(o)
        return o
    now = float(report["now"])
    o.now = now
    o.dependencies = report.get("dependencies", {})
    o.queues = [queue_row(s) for s in report["queues"] or []]
    stale = report.get("stale_commits")
    o.stale_total = None if stale is None else stale[0]
    # Every membership, not only the live ones status lists: a fenced or stopped worker
    # is what an operator looks for during an incident.
    try:
        async with asyncio.timeout(timeout):
            records, o.recent_duplicates = await _memberships(app, now)
    except (StoreError, TimeoutError):  # the channels above already say what fails
        records = report["workers"]
    o.workers = [WorkerRow(w, alive(w, now), now - w.heartbeat_at) for w in records]
    o.alerts = firing_alerts(o)
    return o


def read_drill_results(path: Path | None) -> tuple[list[dict[str, Any]], str | None]:
    """The scenarios of a ``tokenline drill --json`` file, and what is wrong with it."""
    if path is None:
        return [], None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [], f"no drill results at {path} yet"
    except (OSError, ValueError) as exc:
        return [], f"cannot read {path}: {exc}"
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        return [], f"{path} is not the output of `tokenline drill --json`"
    return data, None
