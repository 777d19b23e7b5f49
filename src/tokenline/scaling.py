"""The scale hint: would adding workers help, or hurt?

An autoscaler that adds workers whenever the queue grows amplifies exactly the
incidents tokenline is built for: when a dependency or the coordination channel times
out, more workers mean more calls to what is already failing, more lease renewals to a
store that cannot answer, and a bigger retry storm. :func:`scale_hint` reads two views
of the store taken some seconds apart (:class:`Snapshot`) and answers with an
:class:`Advice` and the reason, in this order:

1. a failing or slow channel (broker, leases, ledger): **hold** — more workers would
   only add load to it;
2. an open circuit breaker of a dependency: **hold** — its jobs are snoozed until it
   heals, and more workers would probe it harder;
3. most live workers draining or fenced: **hold** — they stopped claiming because
   coordination is unhealthy, not for lack of capacity;
4. no live worker and jobs waiting: **add**;
5. jobs waiting, and no fetching worker runs any or has a free slot (their limits came
   down to nothing: sync handlers past their attempts holding every thread, say):
   **hold** — more workers of the same kind would stall the same way;
6. the backlog grew and every fetching worker runs at its concurrency limit: **add**;
7. the backlog grew while workers have free slots: **hold** — worker count is not the
   bottleneck (their adaptive limits came down, a queue is paused, or jobs wait for
   their time);
8. otherwise: **enough**.

Pure: no store, no clock; ``tokenline scale-hint`` and the exporter's ``/scale-hint``
gather the snapshots.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Advice", "Hint", "Snapshot", "WorkerLoad", "scale_hint"]


class Advice(enum.StrEnum):
    """What to do about the number of workers."""

    #: Adding workers would help: work waits for capacity.
    ADD = "add"
    #: Do not add workers: something they depend on is failing, or capacity is not
    #: what is missing.
    HOLD = "hold"
    #: The workers keep up.
    ENOUGH = "enough"


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One live worker as the store last saw it."""

    state: str
    in_flight: int
    #: Its adaptive concurrency limit, or its configured concurrency.
    limit: int

    @property
    def fetching(self) -> bool:
        """Whether it may claim jobs (READY or PROCESSING)."""
        return self.state in ("ready", "processing")

    @property
    def busy(self) -> bool:
        """Whether it runs as many jobs as it may."""
        return self.in_flight >= self.limit


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The store at one moment: backlog, workers, channels and dependencies."""

    #: Store clock, seconds.
    at: float
    #: Jobs runnable now, over all queues not paused: queued ones, and scheduled ones
    #: (delayed, or a retry backing off) whose ``run_at`` has come by the store's clock.
    backlog: int
    #: Age of the oldest ready job, seconds (None: none ready).
    oldest_ready_age: float | None = None
    workers: Sequence[WorkerLoad] = ()
    #: Channel name (broker, leases, ledger) → how it fails ("unreachable", "slow",
    #: "refusing", "not migrated"), for the failing ones only.
    failing_channels: Mapping[str, str] = field(default_factory=dict)
    #: Names of dependencies whose circuit breaker is open.
    open_dependencies: Sequence[str] = ()
    #: Jobs waiting in paused queues (none of them runnable, whatever the workers).
    paused_jobs: int = 0


@dataclass(frozen=True, slots=True)
class Hint:
    """The advice, why, and the figures it rests on."""

    advice: Advice
    reason: str
    figures: Mapping[str, Any]

    def json(self) -> dict[str, Any]:
        """For ``--json`` and the HTTP endpoint."""
        return {"advice": self.advice.value, "reason": self.reason, **self.figures}


def scale_hint(before: Snapshot, after: Snapshot) -> Hint:
    """Whether adding workers would help, judged from two snapshots (``after`` the
    later one); see the module docstring for the rules, in order."""
    live = list(after.workers)
    fetching = [w for w in live if w.fetching]
    busy = [w for w in fetching if w.busy]
    seconds = max(0.0, after.at - before.at)
    figures: dict[str, Any] = {
        "backlog_before": before.backlog,
        "backlog_after": after.backlog,
        "seconds": round(seconds, 3),
        "oldest_ready_age": after.oldest_ready_age,
        "workers": len(live),
        "workers_fetching": len(fetching),
        "workers_busy": len(busy),
        "failing_channels": dict(after.failing_channels),
        "open_dependencies": list(after.open_dependencies),
        "paused_jobs": after.paused_jobs,
    }
    if after.failing_channels:
        what = ", ".join(f"{ch} {how}" for ch, how in sorted(after.failing_channels.items()))
        return Hint(
            Advice.HOLD,
            f"do not add workers: coordination is failing ({what}); more workers would "
            "only add load to it",
            figures,
        )
    if after.open_dependencies:
        names = ", ".join(sorted(after.open_dependencies))
        return Hint(
            Advice.HOLD,
            f"do not add workers: the circuit breaker of {names} is open; its jobs wait "
            "until it heals, and more workers would call it harder",
            figures,
        )
    stalled = len(live) - len(fetching)
    if live and stalled * 2 > len(live):
        return Hint(
            Advice.HOLD,
            f"do not add workers: {stalled} of {len(live)} live workers are draining or "
            "fenced (coordination unhealthy, not capacity)",
            figures,
        )
    if not live and after.backlog > 0:
        return Hint(Advice.ADD, f"{after.backlog} jobs are ready and no worker is live", figures)
    if (
        after.backlog > 0
        and fetching
        and not any(w.in_flight for w in fetching)
        and not any(w.limit > w.in_flight for w in fetching)
    ):
        return Hint(
            Advice.HOLD,
            f"do not add workers: {after.backlog} jobs are ready, and none of the "
            f"{len(fetching)} fetching workers runs a job or has a free slot (their "
            "concurrency limits came down to nothing: handler threads held past their "
            "attempts?); look at those workers",
            figures,
        )
    grew = after.backlog > before.backlog
    if grew and fetching and len(busy) == len(fetching):
        return Hint(
            Advice.ADD,
            f"add workers: the backlog grew from {before.backlog} to {after.backlog} in "
            f"{seconds:.0f}s while every worker runs at its limit",
            figures,
        )
    if grew:
        return Hint(
            Advice.HOLD,
            f"the backlog grew from {before.backlog} to {after.backlog} in {seconds:.0f}s "
            f"but {len(fetching) - len(busy)} of {len(fetching)} workers have free slots: "
            "worker count is not the bottleneck (lowered concurrency limits, paused "
            "queues or a slow store?)",
            figures,
        )
    paused = (
        f"; paused queues hold {after.paused_jobs} jobs (`tokenline resume` runs them)"
        if after.paused_jobs
        else ""
    )
    if not live:
        # "The workers keep up", with none, read as all being well.
        return Hint(Advice.ENOUGH, f"no worker is live, and no job is runnable{paused}", figures)
    return Hint(
        Advice.ENOUGH,
        f"the workers keep up: backlog {before.backlog} → {after.backlog} in "
        f"{seconds:.0f}s{paused}",
        figures,
    )
