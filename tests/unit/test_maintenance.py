"""The maintenance runner: services run only by the leader, one owner per term, a refused
write makes the leader step down, and settings that cannot work are refused."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest

from tokenline import events
from tokenline._clock import FakeClock
from tokenline._errors import ConfigError
from tokenline._jobs import JobState, NewJob
from tokenline.maintenance import (
    MAINTENANCE_LEASE,
    Leadership,
    MaintenanceRunner,
    Rescuer,
    Service,
    ServiceReport,
)
from tokenline.stores import MemoryStore
from tokenline.stores.base import ResourceLease

TTL = 10.0
DEADLINE = 10.0


class Recorder:
    """A service that records who ran it, under which term."""

    name = "recorder"
    interval = 0.01

    def __init__(self, runs: list[tuple[str, int]], owner: str) -> None:
        self.runs = runs
        self.owner = owner
        self.counters: Counter[str] = Counter()

    async def run_once(
        self, *, leader: ResourceLease | None, dry_run: bool = False
    ) -> ServiceReport:
        assert leader is not None
        self.runs.append((self.owner, leader.token))
        return ServiceReport(self.name)


def runner(
    store: MemoryStore, owner: str, clock: FakeClock, *services: Service
) -> MaintenanceRunner:
    leadership = Leadership(store, owner=owner, ttl=TTL, margin=1.0, clock=clock)
    return MaintenanceRunner(leadership, services, renew_interval=0.01)


def test_the_recorder_is_a_service() -> None:
    """The test's recording service has the shape every service has."""
    assert isinstance(Recorder([], "x"), Service)


async def test_two_runners_racing_act_once_per_term(clock: FakeClock) -> None:
    """Two maintenance processes standing in turn, through lapses of the leader: only
    the leader runs its services, and each term's runs all belong to one owner."""
    store = MemoryStore(clock=clock)
    runs: list[tuple[str, int]] = []
    a = runner(store, "a", clock, Recorder(runs, "a"))
    b = runner(store, "b", clock, Recorder(runs, "b"))
    for tick in range(10):
        results = [await r.run_once() for r in ((a, b) if tick % 2 else (b, a))]
        assert sum(r is not None for r in results) == 1
        clock.advance(TTL + 1 if tick % 3 == 2 else 1)
    by_term: dict[int, set[str]] = {}
    for owner, term in runs:
        by_term.setdefault(term, set()).add(owner)
    assert len(runs) == 10
    assert all(len(owners) == 1 for owners in by_term.values())
    assert len(by_term) >= 3


async def test_a_refused_write_makes_the_leader_step_down(clock: FakeClock) -> None:
    """A leader whose term was taken while it still trusted it has its rescue refused by
    the store, reports it, and steps down at once."""
    store = MemoryStore(clock=clock)
    (jid,) = await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="[]")])
    await store.jobs_claim(owner="w", queues=["q"], limit=1, ttl=1)
    a = runner(store, "a", clock, Rescuer(store, interval=1))
    old = await a.leadership.elect()
    assert old is not None
    # A rival takes the lease behind a's back (as after a lapse a's clock did not see).
    await store.resource_lease_release(lease=old)
    rival = await store.resource_lease_acquire(resource=MAINTENANCE_LEASE, owner="b", ttl=TTL)
    assert rival is not None
    clock.advance(2)  # the job's lease expired; a still trusts its term
    (report,) = await a.run_services()
    assert report.refused
    assert a.leadership.current() is None
    assert (await store.job_get(job_id=jid)).state is JobState.RUNNING


async def test_the_runner_gives_its_lease_back_when_stopped() -> None:
    """Running, the runner leads and runs its services; cancelled, it releases the lease
    so another candidate leads at once."""
    store = MemoryStore()
    runs: list[tuple[str, int]] = []
    r = MaintenanceRunner(
        Leadership(store, owner="a", ttl=TTL, margin=1.0, clock=store.clock),
        [Recorder(runs, "a")],
        renew_interval=0.01,
    )
    task = asyncio.create_task(r.run())
    async with asyncio.timeout(DEADLINE):
        while len(runs) < 3:  # noqa: ASYNC110 (polling: no event to wait on)
            await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    other = await store.resource_lease_acquire(resource=MAINTENANCE_LEASE, owner="b", ttl=TTL)
    assert other is not None
    assert other.token == runs[0][1] + 1


async def test_the_runner_reports_repairs_and_terms_as_events(clock: FakeClock) -> None:
    """Each kind a service repaired is an event (for the metrics), and so is the term
    the runner's candidacy wins."""
    seen: list[events.Event] = []
    events.add_hook(seen.append)
    try:
        store = MemoryStore(clock=clock)
        await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="[]")])
        await store.jobs_claim(owner="w", queues=["q"], limit=1, ttl=1)
        clock.advance(2)
        r = runner(store, "a", clock, Rescuer(store, interval=1))
        await r.run_once()
        clock.advance(TTL)  # past its term by its own clock: it steps down
        await r.run_once()
    finally:
        events.remove_hook(seen.append)
    assert events.MaintenanceRepaired("a", "rescuer", "requeued", 1) in seen
    terms = [e.term for e in seen if isinstance(e, events.LeaderChanged)]
    assert terms == [1, 2]  # won, then (past its term by its own clock) a new term


def test_a_service_interval_that_cannot_work_is_refused_at_start_up(clock: FakeClock) -> None:
    """A service whose interval is zero, negative, NaN or not a number is a ConfigError
    naming the service's interval, before anything runs."""
    store = MemoryStore(clock=clock)
    for bad in (0, -1.0, math.nan, math.inf, "5", True):
        service = Rescuer(store, interval=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"rescuer\.interval"):
            runner(store, "a", clock, service)


async def test_a_leader_that_may_not_lead_gives_its_term_back() -> None:
    """A leading worker that becomes fenced (may_lead answers no) releases the lease at
    its next tick instead of holding it to its expiry."""
    store = MemoryStore()
    allowed = [True]
    r = MaintenanceRunner(
        # A TTL far past the test's deadline: only a release can let b in.
        Leadership(store, owner="a", ttl=1000.0, margin=1.0, clock=store.clock),
        [],
        renew_interval=0.01,
        may_lead=lambda: allowed[0],
    )
    task = asyncio.create_task(r.run())
    try:
        async with asyncio.timeout(DEADLINE):
            while r.leadership.term is None:  # noqa: ASYNC110 (polling: no event)
                await asyncio.sleep(0.01)
            allowed[0] = False
            taken = None
            while taken is None:
                await asyncio.sleep(0.01)
                taken = await store.resource_lease_acquire(
                    resource=MAINTENANCE_LEASE, owner="b", ttl=TTL
                )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert r.leadership.term is None


class _LateTerm(MemoryStore):
    """A store whose acquisitions of the maintenance lease answer ``delay`` seconds
    after the store granted them: a won election still on its way back."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.granted = asyncio.Event()

    async def resource_lease_acquire(
        self, *, resource: str, owner: str, ttl: float
    ) -> ResourceLease | None:
        lease = await super().resource_lease_acquire(resource=resource, owner=owner, ttl=ttl)
        if lease is not None:
            self.granted.set()
            await asyncio.sleep(self.delay)
        return lease


async def test_a_runner_stopped_while_its_election_answers_gives_the_term_back() -> None:
    """A runner stopped while the answer to an election it has won is on its way lets
    that answer arrive, then gives the term back: another candidate leads at once,
    instead of after the whole TTL of a term nobody holds."""
    store = _LateTerm(delay=0.3)
    r = MaintenanceRunner(
        # A TTL far past the test's deadline: only a release can let b in.
        Leadership(store, owner="a", ttl=1000.0, margin=1.0, clock=store.clock),
        [],
        renew_interval=5.0,
    )
    task = asyncio.create_task(r.run())
    await asyncio.wait_for(store.granted.wait(), DEADLINE)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    taken = await store.resource_lease_acquire(resource=MAINTENANCE_LEASE, owner="b", ttl=TTL)
    assert taken is not None, "the stopped runner's term is still held"
    assert r.leadership.term is None


class _Buggy(Recorder):
    """A service whose first runs fail with a bug (not a tokenline error)."""

    name = "buggy"

    def __init__(self, runs: list[tuple[str, int]], owner: str, failures: int) -> None:
        super().__init__(runs, owner)
        self.failures = failures

    async def run_once(
        self, *, leader: ResourceLease | None, dry_run: bool = False
    ) -> ServiceReport:
        if self.failures:
            self.failures -= 1
            raise ZeroDivisionError("a bug in the service")
        return await super().run_once(leader=leader, dry_run=dry_run)


async def test_a_service_with_a_bug_is_logged_and_run_again_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A service raising something other than a tokenline error must not end the runner
    (maintenance runs inside every worker): it is logged with its traceback and runs
    again at its next interval, and the other services go on meanwhile."""
    store = MemoryStore()
    buggy_runs: list[tuple[str, int]] = []
    other_runs: list[tuple[str, int]] = []
    r = MaintenanceRunner(
        Leadership(store, owner="a", ttl=TTL, margin=1.0, clock=store.clock),
        [_Buggy(buggy_runs, "a", failures=2), Recorder(other_runs, "a")],
        renew_interval=0.01,
    )
    task = asyncio.create_task(r.run())
    try:
        async with asyncio.timeout(DEADLINE):
            while not buggy_runs:  # noqa: ASYNC110 (polling: no event to wait on)
                await asyncio.sleep(0.01)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert other_runs
    failures = [rec for rec in caplog.records if "buggy failed unexpectedly" in rec.message]
    assert len(failures) == 2
    assert all(rec.exc_info is not None for rec in failures)
