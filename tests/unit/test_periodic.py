"""``@app.periodic``: bad input is refused at registration, naming the setting."""

from __future__ import annotations

from typing import Any

import pytest

from tokenline import App
from tokenline._errors import ConfigError


def register(app: App, **options: Any) -> None:
    def job(ctx: Any) -> None:
        """A periodic task."""

    app.periodic(**{"name": "job", **options})(job)


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "every minute"}, "cron"),
        ({"cron": ""}, "cron"),
        ({"cron": "0 0 30 2 *"}, "cron"),  # February 30th: never
        ({"cron": "0 0 31 4 *"}, "cron"),  # April 31st: never
        ({"cron": "0 0 * * * * *"}, "cron"),  # seven fields
        ({"cron": "* * * *"}, "cron"),  # four fields
        ({"cron": 5}, "cron"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "timezone"),
        ({"cron": "* * * * *", "timezone": ""}, "timezone"),
        ({"cron": "* * * * *", "timezone": "../etc/passwd"}, "timezone"),
        # Links to the machine's own zone in the zone database: accepted, they read the
        # schedule in whatever zone each host had.
        ({"cron": "* * * * *", "timezone": "localtime"}, "timezone"),
        ({"cron": "* * * * *", "timezone": "posixrules"}, "timezone"),
        ({"cron": "* * * * *", "catch_up": "some"}, "catch_up"),
        ({"cron": "* * * * *", "queue": "bad queue"}, "queue"),
    ],
)
def test_bad_schedule_settings_are_refused_by_name(options: dict[str, Any], setting: str) -> None:
    """An invalid cron, zone, catch-up mode or queue is a ConfigError naming it."""
    app = App("memory://")
    with pytest.raises(ConfigError) as caught:
        register(app, **options)
    assert caught.value.setting == setting
    assert app.periodics == {}
    assert app.tasks == {}


@pytest.mark.parametrize(
    ("cron", "why"),
    [
        ("0 0 30 2 *", "never matches"),
        ("0 0 * * * * *", "has 7 fields"),
        ("* * * *", "has 4 fields"),
        ("61 * * * *", "not a valid cron expression"),
        # croniter took a range written high to low for every value of its field.
        ("1-0 * * * *", "the minute field's range '1-0' runs backwards"),
        ("0 0 * * 5-1", "low to high, or as two ranges .'5-6,0-1'."),
        ("* * * * * 50-10/5", "the second field's range '50-10' runs backwards"),
    ],
)
def test_a_bad_cron_is_named_with_the_reason(cron: str, why: str) -> None:
    """The error names the expression and says what is wrong with it: a cron that never
    matches would otherwise be found only by the scheduler, at every pass."""
    with pytest.raises(ConfigError, match=why) as caught:
        register(App("memory://"), cron=cron)
    assert repr(cron) in str(caught.value)


@pytest.mark.parametrize("cron", ["0 0 29 2 *", "*/10 * * * * *", "@daily", "0 12 * * mon-fri"])
def test_rare_or_named_crons_are_accepted(cron: str) -> None:
    """February 29th (every four years), six fields and croniter's names are schedules."""
    app = App("memory://")
    register(app, cron=cron)
    assert app.periodics["job"].cron == cron


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"args": [object()]}, "args[0] of task 'nightly' is a object, which JSON cannot"),
        ({"args": [1]}, "1 positional arguments given, at most 0 taken"),
        ({"kwargs": {"x": 1}}, "unexpected keyword argument 'x'"),
    ],
)
def test_arguments_are_checked_like_an_enqueue(options: dict[str, Any], said: str) -> None:
    """Arguments that could not make a job are refused at registration, as a
    ConfigError (it was a PayloadError, which the README does not promise) naming the
    periodic and, in the enqueue's words, what does not fit; nothing is registered."""
    app = App("memory://")
    with pytest.raises(ConfigError) as caught:

        @app.periodic(cron="* * * * *", name="nightly", **options)
        def tick(ctx: Any) -> None:
            """A handler that takes no argument."""

    assert caught.value.setting == "args"
    assert caught.value.reason.startswith("periodic 'nightly': ")
    assert said in caught.value.reason
    assert app.tasks == {}
    assert app.periodics == {}


def test_a_schedule_registers_its_task_and_keeps_its_options() -> None:
    """The function becomes a task; the schedule names it, with its zone and mode."""
    app = App("memory://")

    @app.periodic(
        cron="*/5 * * * *", timezone="Europe/Paris", catch_up="all", args=[1], name="report"
    )
    def report(ctx: Any, n: int) -> None:
        """A periodic task."""

    (schedule,) = app.periodics.values()
    assert schedule.task in app.tasks
    assert (schedule.cron, schedule.timezone, schedule.catch_up, schedule.args) == (
        "*/5 * * * *",
        "Europe/Paris",
        "all",
        (1,),
    )
    assert app.on("memory://").periodics == app.periodics


def test_two_different_schedules_cannot_share_a_name() -> None:
    """Each name has one mark in the store: a second schedule of that name is refused."""
    app = App("memory://")
    register(app, cron="* * * * *", name="n")
    with pytest.raises(ConfigError) as caught:
        register(app, cron="*/2 * * * *", name="n")
    assert caught.value.setting == "name"


@pytest.mark.parametrize(("mode", "enqueued"), [("latest", 1), ("all", 1000)])
async def test_after_a_long_outage_latest_runs_the_latest_instant(mode: str, enqueued: int) -> None:
    """5,000 missed seconds: ``latest`` enqueues the last one (not the oldest of a
    capped list); ``all`` catches up 1,000 per pass, oldest first."""
    from tokenline._clock import FakeClock
    from tokenline.maintenance.scheduler import Scheduler
    from tokenline.stores import MemoryStore

    clock = FakeClock()
    app = App("memory://", clock=clock)
    register(app, cron="* * * * * *", catch_up=mode)
    store = MemoryStore(clock=clock)
    lease = await store.resource_lease_acquire(resource="m", owner="a", ttl=1e6)
    assert lease is not None
    sched = Scheduler(store, app, max_per_pass=1000)
    start = clock.now()
    await sched.run_once(leader=lease)
    clock.advance(5000)
    report = await sched.run_once(leader=lease)
    assert report.counts["periodic_enqueued"] == enqueued
    marks = await store.schedule_marks()
    assert marks["job"] == (clock.now() if mode == "latest" else start + 1000)


def _broken(app: App, name: str, cron: str) -> None:
    """Register a schedule whose cron croniter cannot compute, as if validation had been
    bypassed (or croniter gave up on an expression it accepted)."""
    register(app, cron="* * * * *", name=name)
    object.__setattr__(app._periodic[name], "cron", cron)


async def test_a_schedule_that_cannot_be_computed_is_skipped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A schedule whose next instant raises is logged as an error naming it and skipped;
    the schedules after it still run, and the pass does not raise."""
    import logging

    from tokenline._clock import FakeClock
    from tokenline.maintenance.scheduler import Scheduler
    from tokenline.stores import MemoryStore

    clock = FakeClock()
    app = App("memory://", clock=clock)
    _broken(app, "feb30", "0 0 30 2 *")
    register(app, cron="* * * * * *", name="every-second")
    store = MemoryStore(clock=clock)
    lease = await store.resource_lease_acquire(resource="m", owner="a", ttl=1e6)
    assert lease is not None
    sched = Scheduler(store, app)
    await sched.run_once(leader=lease)  # first sight: both marks start now
    with caplog.at_level(logging.ERROR, logger="tokenline.maintenance"):
        for _ in range(3):
            clock.advance(1)
            report = await sched.run_once(leader=lease)
            assert report.counts["periodic_enqueued"] == 1  # every-second's instant
    assert not report.refused
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # once, not at every pass
    assert "'feb30'" in errors[0].getMessage()
    assert "0 0 30 2 *" in errors[0].getMessage()
    assert sched.counters["periodic_failed"] == 3
    assert sched.counters["periodic_enqueued"] == 3
    dry = await sched.run_once(leader=None, dry_run=True)
    assert any("'feb30'" in line and "skipped" in line for line in dry.lines)


async def test_a_broken_schedule_does_not_stop_the_other_maintenance_services() -> None:
    """The runner (which lives inside every worker) runs the scheduler and then the
    next service, and neither raises, whatever one schedule's cron does."""
    from collections import Counter

    from tokenline._clock import FakeClock
    from tokenline.maintenance import Leadership, MaintenanceRunner, ServiceReport
    from tokenline.maintenance.scheduler import Scheduler
    from tokenline.stores import MemoryStore
    from tokenline.stores.base import ResourceLease

    class Next:
        name = "next"
        interval = 1.0

        def __init__(self) -> None:
            self.counters: Counter[str] = Counter()

        async def run_once(
            self, *, leader: ResourceLease | None, dry_run: bool = False
        ) -> ServiceReport:
            self.counters["ran"] += 1
            return ServiceReport(self.name)

    clock = FakeClock()
    app = App("memory://", clock=clock)
    _broken(app, "seven", "0 0 * * * * 1999")
    store = MemoryStore(clock=clock)
    after = Next()
    leadership = Leadership(store, owner="a", ttl=10.0, margin=1.0, clock=clock)
    runner = MaintenanceRunner(leadership, [Scheduler(store, app), after], renew_interval=1.0)
    for _ in range(2):
        reports = await runner.run_once()
        clock.advance(1)
        assert reports is not None
        assert not any(r.refused for r in reports)
    assert after.counters["ran"] == 2


async def test_a_periodic_enqueue_is_logged_as_information_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A schedule every second logged a warning every second, for work that went as it
    should: routine lines (a schedule started, a periodic job enqueued) are now logged
    at INFO; warnings stay for repairs."""
    import logging

    from tokenline._clock import FakeClock
    from tokenline.maintenance import Leadership, MaintenanceRunner
    from tokenline.maintenance.scheduler import Scheduler
    from tokenline.stores import MemoryStore

    clock = FakeClock()
    app = App("memory://", clock=clock)
    register(app, cron="* * * * * *", name="every-second")
    store = MemoryStore(clock=clock)
    leadership = Leadership(store, owner="a", ttl=10.0, margin=1.0, clock=clock)
    runner = MaintenanceRunner(leadership, [Scheduler(store, app)], renew_interval=1.0)
    with caplog.at_level(logging.INFO, logger="tokenline.maintenance"):
        for _ in range(3):
            assert await runner.run_once() is not None
            clock.advance(1)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "scheduler" in r.getMessage()]
    enqueued = [level for level, text in said if "enqueued periodic:" in text]
    assert enqueued == [logging.INFO, logging.INFO]  # the first pass only starts the mark
    assert all(level < logging.WARNING for level, _ in said), said


async def test_a_worker_says_when_the_leader_does_not_run_its_schedule(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A maintenance leader whose app lacks a schedule (``tokenline maintenance`` with
    no ``--app``, a worker of an older deploy) never enqueued it, and nothing said so:
    the schedule silently never ran. A worker whose app has it, and which does not
    lead, now says so, naming the schedule and the leader, once per term."""
    import asyncio
    import dataclasses
    import logging

    from tokenline import WorkerSettings
    from tokenline.maintenance import MAINTENANCE_LEASE
    from tokenline.stores import MemoryStore
    from tokenline.worker import Worker

    app = App("memory://")
    register(app, cron="* * * * * *", name="tick")
    store = MemoryStore()
    held = await store.resource_lease_acquire(
        resource=MAINTENANCE_LEASE, owner="dedicated", ttl=1e3
    )
    assert held is not None  # a leader without the schedule
    settings = dataclasses.replace(
        WorkerSettings(), lease_ttl=0.6, renew_interval=0.15, periodic_interval=0.05
    )
    worker = Worker(app, settings, store=store)
    task = asyncio.create_task(worker.run())

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "is not being run" in r.getMessage()]

    try:
        with caplog.at_level(logging.WARNING, logger="tokenline.maintenance"):
            async with asyncio.timeout(30):
                while not said():  # noqa: ASYNC110 (polling: no event to wait on)
                    await asyncio.sleep(0.05)
                await asyncio.sleep(2.5)  # more looks: still said once for this term
    finally:
        worker.request_shutdown()
        worker.request_shutdown()
        await asyncio.wait_for(task, 30)
    (line,) = said()
    assert line.startswith(
        "periodic schedule 'tick' is not being run: the maintenance leader dedicated (term 1) "
        "has never started it"
    ), line
    assert await store.schedule_marks() == {}
