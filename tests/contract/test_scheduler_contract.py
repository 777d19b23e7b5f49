"""The periodic-job scheduler on every store: each instant at most once, catch-up
modes, time zones across daylight saving time, and leaders that race or are deposed."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from tokenline import App
from tokenline._clock import FakeClock
from tokenline.maintenance._service import Service
from tokenline.maintenance.scheduler import Scheduler
from tokenline.stores.base import ResourceLease

MAINT = "tokenline:maintenance"
Q = ["default"]


def app_with(clock: FakeClock, cron: str, **options: Any) -> App:
    app = App("memory://", clock=clock)

    @app.periodic(cron=cron, name="tick", **options)
    def tick(ctx: Any) -> None:
        """A periodic task."""

    return app


async def take(store: Any, owner: str = "leader-a", ttl: float = 10_000.0) -> ResourceLease:
    lease = await store.resource_lease_acquire(resource=MAINT, owner=owner, ttl=ttl)
    assert lease is not None
    return lease


async def keys(store: Any) -> list[str]:
    jobs = await store.jobs_list(limit=10_000)
    return sorted(j.idempotency_key for j in jobs)


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def test_a_new_schedule_starts_now_and_enqueues_each_later_instant_once(
    store: Any, clock: FakeClock
) -> None:
    """Every-second schedule: the first pass only sets the mark; after five seconds
    the next pass enqueues exactly those five instants, and a repeat pass nothing."""
    sched = Scheduler(store, app_with(clock, "* * * * * *", catch_up="all"))
    assert isinstance(sched, Service)
    lead = await take(store)
    start = clock.now()
    await sched.run_once(leader=lead)
    assert await keys(store) == []
    clock.advance(5)
    report = await sched.run_once(leader=lead)
    assert report.counts == {"periodic_enqueued": 5}
    assert await keys(store) == [f"periodic:tick:{iso(start + s)}" for s in range(1, 6)]
    again = await sched.run_once(leader=lead)
    assert again.total == 0
    assert len(await keys(store)) == 5


@pytest.mark.parametrize(
    ("mode", "enqueued", "skipped"), [("all", 10, 0), ("latest", 1, 9), ("skip", 0, 10)]
)
async def test_missed_instants_follow_the_catch_up_mode(
    store: Any, clock: FakeClock, mode: str, enqueued: int, skipped: int
) -> None:
    """Ten and a half minutes without a leader: ``all`` enqueues the ten missed
    instants, ``latest`` the last, ``skip`` none (the last is 30 s late, past the
    grace); the mark moves past all of them either way."""
    clock.advance(60 - clock.now() % 60)  # on a minute boundary
    sched = Scheduler(store, app_with(clock, "* * * * *", catch_up=mode), interval=1.0)
    lead = await take(store)
    await sched.run_once(leader=lead)
    clock.advance(630)
    report = await sched.run_once(leader=lead)
    assert report.counts["periodic_enqueued"] == enqueued
    assert report.counts["periodic_skipped"] == skipped
    assert len(await keys(store)) == enqueued
    assert (await store.schedule_marks())["tick"] == clock.now() - 30
    clock.advance(30)  # the next instant, seen on time, runs in every mode
    report = await sched.run_once(leader=lead)
    assert report.counts == {"periodic_enqueued": 1}


async def test_instants_in_an_explicit_zone_across_daylight_saving_time(
    store: Any, clock: FakeClock
) -> None:
    """Europe/Paris, 02:30 daily: on the spring-forward day it runs at 03:00 local, on
    the fall-back day at both 02:30s (an hour apart); every instant once, in order."""
    paris = ZoneInfo("Europe/Paris")
    clock.advance(dt.datetime(2026, 3, 27, 12, tzinfo=paris).timestamp() - clock.now())
    sched = Scheduler(store, app_with(clock, "30 2 * * *", timezone="Europe/Paris", catch_up="all"))
    lead = await take(store, ttl=1e9)
    await sched.run_once(leader=lead)
    clock.advance(dt.datetime(2026, 3, 30, 12, tzinfo=paris).timestamp() - clock.now())
    await sched.run_once(leader=lead)
    spring = [
        "periodic:tick:2026-03-28T01:30:00Z",  # 02:30 CET
        "periodic:tick:2026-03-29T01:00:00Z",  # 03:00 CEST: 02:30 does not exist
        "periodic:tick:2026-03-30T00:30:00Z",  # 02:30 CEST
    ]
    assert await keys(store) == spring
    clock.advance(dt.datetime(2026, 10, 24, 12, tzinfo=paris).timestamp() - clock.now())
    report = await sched.run_once(leader=lead)
    assert report.counts["periodic_enqueued"] == 208  # every day from Mar 31 to Oct 24
    clock.advance(dt.datetime(2026, 10, 25, 12, tzinfo=paris).timestamp() - clock.now())
    report = await sched.run_once(leader=lead)
    assert report.counts == {"periodic_enqueued": 2}
    fall = ["periodic:tick:2026-10-25T00:30:00Z", "periodic:tick:2026-10-25T01:30:00Z"]
    assert (await keys(store))[-2:] == fall


async def test_two_schedulers_racing_enqueue_each_instant_once(
    store_pair: tuple[Any, Any], clock: FakeClock
) -> None:
    """Two schedulers (two connections) passing at once with a valid lease: the mark
    lets each instant in once."""
    one, two = store_pair
    app = app_with(clock, "* * * * * *", catch_up="all")
    lead = await take(one)
    first, second = Scheduler(one, app), Scheduler(two, app)
    await first.run_once(leader=lead)
    for _ in range(3):
        clock.advance(4)
        a, b = await asyncio.gather(first.run_once(leader=lead), second.run_once(leader=lead))
        assert a.counts["periodic_enqueued"] + b.counts["periodic_enqueued"] == 4
    found = await keys(one)
    assert len(found) == len(set(found)) == 12


async def test_a_deposed_leader_enqueues_nothing_and_the_next_one_resumes_at_the_mark(
    store: Any, clock: FakeClock
) -> None:
    """The old leader's pass is refused; the new leader enqueues exactly the instants
    after the mark, none twice, none skipped (catch_up="all"), though the old ones ran."""
    app = app_with(clock, "* * * * * *", catch_up="all")
    old = await take(store, "leader-a", ttl=5)
    sched_a = Scheduler(store, app)
    await sched_a.run_once(leader=old)
    clock.advance(3)
    await sched_a.run_once(leader=old)
    for claimed in await store.jobs_claim(owner="w", queues=Q, limit=10, ttl=10):
        await store.job_complete(lease=claimed.lease)
    clock.advance(4)  # a's lease has expired
    new = await take(store, "leader-b", ttl=5)
    report = await sched_a.run_once(leader=old)
    assert report.refused
    assert report.total == 0
    await Scheduler(store, app).run_once(leader=new)
    found = await keys(store)
    assert len(found) == len(set(found)) == 7
