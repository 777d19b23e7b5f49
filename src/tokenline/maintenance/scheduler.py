"""The periodic-job scheduler: the maintenance leader enqueues each due instant once.

Every ``interval`` seconds the leader reads the store's clock and every schedule's
**high-water mark** (the last instant it handled), and for each schedule of the app
(``@app.periodic``) enqueues the instants in ``(mark, now]`` as its ``catch_up`` mode
says (``_periodic.py``). Each enqueue is :meth:`~tokenline.stores.base.Broker.
schedule_advance`: one transaction that checks the leader's lease, moves the mark to the
instant *only if the mark is below it*, and inserts the job — all or nothing.

**Why no instant runs twice, whatever the timing.** A job's unique key alone cannot
promise it: the key of instant *t* (``periodic:<name>:<t>``, ``unique="active"``) is
released when *t*'s job finishes, so a leader that did not know *t* was done (deposed
and paused mid-pass, or new and reading an old view) could enqueue *t* again after it
ran. The mark closes that hole:

1. the mark only moves forwards (the store's conditional update, ``mark < instant``),
   and the job of *t* is inserted in the same transaction that moves the mark to *t*;
2. so once *t*'s job exists, the mark is at or past *t* for ever after, and every later
   attempt to enqueue *t* — by any leader, with any view, at any time — finds
   ``mark >= t`` and writes nothing.

Hence at most one job per instant, from store facts alone; no clock, lease duration or
process speed enters the argument. The leader fence (``leader_holds`` in the same
transaction) adds that a deposed leader writes nothing at all — not even a later
instant early. The tests take the mark check out (``tests/sabotage.py``) and see an
instant run twice.

**Why none is skipped** (``catch_up="all"``): the mark moves only with an enqueue of
that very instant (or past instants a mode chose to skip), so every instant after the
mark is still due for whoever leads next; a new leader starts from the stored mark,
not from its own start time. A schedule seen for the first time starts at that
moment: its mark is set to the store's now, and only later instants are due.

**One broken schedule stops nothing else.** ``@app.periodic`` refuses a cron that never
matches, but a schedule may still fail to compute or build its next job (croniter
giving up on it, its task gone from the app): that schedule is logged as an error and
skipped, its mark left where it is, and the pass goes on with the others. The
maintenance runner lives inside every worker: an exception out of a pass would stop
the worker. Only the store's failures end a pass (the runner retries it later).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from .._errors import FencedError, NotSupportedError, StaleTokenError, StoreError
from .._jobs import exception_text
from .._periodic import Periodic
from ..stores.base import ResourceLease, Store
from ._service import ServiceReport

if TYPE_CHECKING:
    from .._app import App
    from .._config import WorkerSettings

__all__ = ["Scheduler"]

log = logging.getLogger("tokenline.maintenance")


class Scheduler:
    """The periodic-job service (``name = "scheduler"``); see the module docstring.

    ``grace``: in ``catch_up="skip"`` mode, how late (seconds, store time) an instant
    may be seen and still run; default twice the interval. ``max_per_pass``: most
    instants one schedule enqueues per pass (a long outage with ``"all"`` catches up
    over several passes, in order); in the other modes the latest instant is found
    directly, and the skipped ones are counted up to this many.
    """

    name = "scheduler"

    def __init__(
        self,
        store: Store,
        app: App,
        *,
        interval: float = 1.0,
        grace: float | None = None,
        max_per_pass: int = 1000,
    ) -> None:
        self.store = store
        self.app = app
        self.interval = interval
        self.grace = grace if grace is not None else 2 * interval
        self.max_per_pass = max_per_pass
        self.counters: Counter[str] = Counter()
        #: The error last logged per failing schedule: logged again only when it
        #: changes, not at every pass.
        self._failing: dict[str, str] = {}

    @classmethod
    def from_settings(cls, store: Store, app: App, settings: WorkerSettings) -> Scheduler:
        """A scheduler of ``app``'s schedules, every ``settings.periodic_interval``."""
        return cls(store, app, interval=settings.periodic_interval)

    async def run_once(
        self, *, leader: ResourceLease | None, dry_run: bool = False
    ) -> ServiceReport:
        """Enqueue every due instant of every schedule (``dry_run``: report them)."""
        if leader is None and not dry_run:
            raise ValueError("run_once needs the leader's lease unless dry_run")
        report = ServiceReport(self.name, dry_run=dry_run)
        now = await self.store.store_time()
        marks = await self.store.schedule_marks()
        for schedule in self.app.periodics.values():
            try:
                await self._schedule(schedule, marks.get(schedule.name), now, leader, report)
            except StaleTokenError:
                report.refused = True
                break
            except (StoreError, NotSupportedError, FencedError):
                raise  # the store's failure, not the schedule's: the runner retries
            except Exception as exc:
                self._failed(schedule, exc, report)
            else:
                self._failing.pop(schedule.name, None)
        if not dry_run:
            self.counters.update(report.counts)
        return report

    def _failed(self, schedule: Periodic, exc: Exception, report: ServiceReport) -> None:
        """Log that ``schedule`` could not be run this pass, once per distinct error."""
        why = exception_text(exc)
        line = (
            f"schedule {schedule.name!r} (cron {schedule.cron!r}) skipped: {why}; "
            "the other schedules run"
        )
        if report.dry_run:
            report.lines.append(line)
            return
        self.counters["periodic_failed"] += 1
        if self._failing.get(schedule.name) != why:
            self._failing[schedule.name] = why
            log.error("scheduler: %s", line, exc_info=exc)

    async def _schedule(
        self,
        schedule: Periodic,
        mark: float | None,
        now: float,
        leader: ResourceLease | None,
        report: ServiceReport,
    ) -> None:
        if mark is None:
            report.routine.append(f"schedule {schedule.name!r} starts now")
            if leader is not None and not report.dry_run:
                await self._advance(leader, schedule, now, with_job=False)
            return
        due = schedule.instants(mark, now, self.max_per_pass)
        if not due:
            return
        if schedule.catch_up != "all" and len(due) == self.max_per_pass:
            # A long outage: the oldest instants are listed, the latest is what runs.
            last = schedule.latest(now)
            if last > due[-1]:
                due.append(last)
        if schedule.catch_up == "all":
            run = due
        elif schedule.catch_up == "latest":
            run = due[-1:]
        else:
            run = [t for t in due[-1:] if now - t <= self.grace]
        skipped = len(due) - len(run)
        if skipped:
            report.counts["periodic_skipped"] += skipped
            report.lines.append(
                f"schedule {schedule.name!r}: {skipped} missed instant(s) skipped "
                f"(catch_up={schedule.catch_up})"
            )
        if report.dry_run or leader is None:
            report.counts["periodic_enqueued"] += len(run)
            return
        if not run:
            await self._advance(leader, schedule, due[-1], with_job=False)
        for instant in run:
            if await self._advance(leader, schedule, instant, with_job=True):
                report.counts["periodic_enqueued"] += 1
                report.routine.append(f"enqueued {schedule.key(instant)}")
            else:
                report.counts["periodic_already_handled"] += 1

    async def _advance(
        self, leader: ResourceLease, schedule: Periodic, instant: float, *, with_job: bool
    ) -> bool:
        job = None
        if with_job:
            job = self.app.build_job(
                schedule.task,
                schedule.args,
                schedule.kwargs,
                idempotency_key=schedule.key(instant),
                unique="active",
                queue=schedule.queue,
            )
        return await self.store.schedule_advance(
            leader=leader, schedule=schedule.name, instant=instant, job=job
        )
