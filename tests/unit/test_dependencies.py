"""Named dependencies and their circuit breakers, shared through the store: how workers
agree on open, half-open and closed, how jobs that need an open dependency wait without
spending attempts, and which settings and names are refused."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tokenline import (
    App,
    ConfigError,
    DependencyOpenError,
    FakeClock,
    InvalidInputError,
    JobContext,
    JobState,
    Worker,
    events,
)
from tokenline.backpressure import BreakerState, CallOutcome
from tokenline.cli.status import _status
from tokenline.dependencies import (
    PROBE_MARGIN,
    VIEW_MAX_AGE,
    BreakerBoard,
    Dependency,
    DependencyRegistry,
    read_shared,
)
from tokenline.metrics import StoreCollector, WorkerMetrics
from tokenline.stores import MemoryStore, Store
from tokenline.stores.base import ResourceLease
from unit.test_worker import FAST, NO_BACKOFF, eventually, eventually_async, running

DEP = "payments-api"
OPEN_LEASE = "tokenline:breaker:payments-api"
PROBE_LEASE = "tokenline:breaker:payments-api:probe"


# -- the shared view, read from leases --------------------------------------------------------


def lease(resource: str, owner: str, expires_at: float, acquired_at: float) -> ResourceLease:
    return ResourceLease(resource, owner, 1, expires_at, acquired_at=acquired_at)


def test_the_store_leases_say_open_half_open_or_closed() -> None:
    """Held open lease: open. Expired: half-open, busy while someone holds the probe
    lease. A 'closed by' record taken after the opening: closed. A probe that merely
    expired, or a record older than the opening: half-open again."""
    opened = lease(OPEN_LEASE, "w1", expires_at=160.0, acquired_at=100.0)
    assert read_shared([opened], now=150.0)[DEP].state is BreakerState.OPEN
    assert read_shared([opened], now=150.0)[DEP].open_until == 160.0
    assert read_shared([opened], now=170.0)[DEP].state is BreakerState.HALF_OPEN
    probing = lease(PROBE_LEASE, "w2", expires_at=175.0, acquired_at=165.0)
    seen = read_shared([opened, probing], now=170.0)[DEP]
    assert (seen.state, seen.prober, seen.probe_until) == (BreakerState.HALF_OPEN, "w2", 175.0)
    crashed = read_shared([opened, probing], now=180.0)[DEP]
    assert (crashed.state, crashed.prober) == (BreakerState.HALF_OPEN, None)
    closed = lease(PROBE_LEASE, "closed by w2", expires_at=168.0, acquired_at=168.0)
    assert read_shared([opened, closed], now=170.0)[DEP].state is BreakerState.CLOSED
    reopened = lease(OPEN_LEASE, "w3", expires_at=190.0, acquired_at=169.0)
    assert read_shared([reopened, closed], now=195.0)[DEP].state is BreakerState.HALF_OPEN


def test_other_leases_are_not_breakers() -> None:
    """Only tokenline:breaker:<name> leases are read; a name has no ':'."""
    others = [
        lease("tokenline:maintenance", "w1", 200.0, 100.0),
        lease("account:42", "w1", 200.0, 100.0),
        lease(PROBE_LEASE, "w1", 200.0, 100.0),
    ]
    assert read_shared(others, now=150.0) == {}


# -- two workers' boards on one store, on a fake clock -------------------------------------


def boards(clock: FakeClock, **settings: Any) -> tuple[MemoryStore, BreakerBoard, BreakerBoard]:
    store = MemoryStore(clock=clock)
    registry = DependencyRegistry()
    options = {"timeout": 2.0, "min_calls": 2, "window": 10.0, "open_for": 30.0}
    registry.add(Dependency(DEP, **(options | settings)))
    a = BreakerBoard(registry, worker_id="wa", clock=clock)
    b = BreakerBoard(registry, worker_id="wb", clock=clock)
    a.bind(store)
    b.bind(store)
    return store, a, b


async def calls(board: BreakerBoard, outcome: CallOutcome, n: int = 1) -> None:
    for _ in range(n):
        permit = await board.admit(DEP)
        await board.finish(DEP, permit, outcome, 0.1)


async def test_one_board_trips_and_the_other_sees_it_open_within_the_view_age(
    clock: FakeClock,
) -> None:
    """A's breaker opens and takes the open lease; B, whose view was read just before,
    may still call for less than VIEW_MAX_AGE, then refuses with the time left."""
    store, a, b = boards(clock)
    await calls(b, CallOutcome.OK)  # B's view is read now: closed
    await calls(a, CallOutcome.FAILED, 2)
    assert a.state(DEP) is BreakerState.OPEN
    (held,) = [r for r in await store.resource_leases_list() if r.resource == OPEN_LEASE]
    assert (held.owner, held.expires_at) == ("wa", clock.now() + 30.0)
    clock.advance(VIEW_MAX_AGE / 2)
    await calls(b, CallOutcome.OK)  # a view younger than VIEW_MAX_AGE is trusted
    clock.advance(VIEW_MAX_AGE / 2)
    with pytest.raises(DependencyOpenError) as info:
        await b.admit(DEP)
    assert info.value.dependency == DEP
    assert info.value.retry_after == pytest.approx(29.0, abs=0.01)
    assert b.state(DEP) is BreakerState.OPEN


async def test_half_open_lets_one_worker_probe_and_its_success_closes_everywhere(
    clock: FakeClock,
) -> None:
    """After open_for, A takes the probe lease for its trial; B is refused meanwhile
    (the store says the probe is held). A's success leaves a 'closed by' record, and B
    closes at its next read without a trial of its own."""
    store, a, b = boards(clock)
    await calls(a, CallOutcome.FAILED, 2)
    clock.advance(30.0)
    trial = await a.admit(DEP)
    assert trial.trial
    with pytest.raises(DependencyOpenError) as info:
        await b.admit(DEP)
    assert info.value.state == "half_open"
    assert b.state(DEP) is BreakerState.HALF_OPEN
    await a.finish(DEP, trial, CallOutcome.OK, 0.1)
    assert a.state(DEP) is BreakerState.CLOSED
    shared = read_shared(await store.resource_leases_list(), clock.now())
    assert shared[DEP].state is BreakerState.CLOSED
    clock.advance(VIEW_MAX_AGE)
    permit = await b.admit(DEP)
    assert not permit.trial
    assert b.state(DEP) is BreakerState.CLOSED


async def test_a_failed_probe_opens_it_again_for_everyone(clock: FakeClock) -> None:
    """A's trial fails: it takes the open lease again, and B sees a full open_for."""
    _, a, b = boards(clock)
    await calls(a, CallOutcome.FAILED, 2)
    clock.advance(30.0)
    trial = await a.admit(DEP)
    clock.advance(2.0)
    await a.finish(DEP, trial, CallOutcome.TIMEOUT, 2.0)
    assert a.state(DEP) is BreakerState.OPEN
    with pytest.raises(DependencyOpenError) as info:
        await b.admit(DEP)
    assert info.value.retry_after == pytest.approx(30.0, abs=0.01)


async def test_a_probe_whose_worker_vanished_lets_another_probe_after_its_ttl(
    clock: FakeClock,
) -> None:
    """A took the probe lease and never reported: B is refused until the probe lease
    expires (timeout + margin), then probes itself; the lapse closed nothing."""
    _, a, b = boards(clock)
    await calls(a, CallOutcome.FAILED, 2)
    clock.advance(30.0)
    await a.admit(DEP)  # A's worker dies mid-trial
    with pytest.raises(DependencyOpenError):
        await b.admit(DEP)
    clock.advance(2.0 + PROBE_MARGIN + 0.1)
    trial = await b.admit(DEP)
    assert trial.trial
    await b.finish(DEP, trial, CallOutcome.OK, 0.1)
    assert b.state(DEP) is BreakerState.CLOSED


async def test_the_gate_defers_jobs_while_open_and_lets_one_trial_job_through(
    clock: FakeClock,
) -> None:
    """hold_back: open → wait the time left; half-open → the first job of a claim may
    probe, the next waits a second; another worker probing → wait for its probe."""
    _, a, b = boards(clock)
    await calls(a, CallOutcome.FAILED, 2)
    clock.advance(10.0)
    trials: dict[str, int] = {}
    assert a.hold_back([DEP], trials) == (DEP, pytest.approx(20.0), BreakerState.OPEN)
    clock.advance(20.0)
    assert a.hold_back([DEP], trials) is None
    assert a.hold_back([DEP], trials) == (DEP, 1.0, BreakerState.HALF_OPEN)
    await a.admit(DEP)  # A probes
    await b.refresh_if_stale()
    name, delay, state = b.hold_back([DEP], {}) or ("", 0.0, BreakerState.CLOSED)
    assert (name, state) == (DEP, BreakerState.HALF_OPEN)
    assert delay == pytest.approx(2.0 + PROBE_MARGIN)


async def test_calls_that_say_nothing_about_the_dependency_free_the_trial(
    clock: FakeClock,
) -> None:
    """A trial that ends without an outcome (Permanent, a cancelled job) releases the
    probe lease: another worker may probe at once."""
    _, a, b = boards(clock)
    await calls(a, CallOutcome.FAILED, 2)
    clock.advance(30.0)
    trial = await a.admit(DEP)
    await a.finish(DEP, trial, None, 0.1)
    assert a.state(DEP) is BreakerState.HALF_OPEN
    assert (await b.admit(DEP)).trial


async def test_breaker_changes_and_calls_are_events(clock: FakeClock) -> None:
    """Every call outcome is a DependencyCall, every change of state a BreakerChanged."""
    heard: list[events.Event] = []
    _, a, _ = boards(clock)
    events.add_hook(heard.append)
    try:
        await calls(a, CallOutcome.OK, 2)
        await calls(a, CallOutcome.FAILED, 2)
        with pytest.raises(DependencyOpenError):
            await a.admit(DEP)
    finally:
        events.remove_hook(heard.append)
    outcomes = [e.outcome for e in heard if isinstance(e, events.DependencyCall)]
    assert outcomes == ["ok", "ok", "failed", "failed", "rejected"]
    changes = [(e.old, e.new) for e in heard if isinstance(e, events.BreakerChanged)]
    assert changes == [("closed", "open")]


# -- settings and names ---------------------------------------------------------------------


def test_app_dependency_returns_its_settings_with_the_stated_defaults() -> None:
    """Defaults: 10 s timeout, 50% of at least 20 calls over 30 s, open 60 s, one trial."""
    dep = App("memory://").dependency(DEP)
    assert (dep.timeout, dep.failure_rate, dep.window, dep.min_calls) == (10.0, 0.5, 30.0, 20)
    assert (dep.open_for, dep.probe_calls, dep.slow_call) == (60.0, 1, None)
    assert (dep.open_lease, dep.probe_lease) == (OPEN_LEASE, PROBE_LEASE)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("timeout", 0),
        ("timeout", math.inf),
        ("failure_rate", 0.0),
        ("failure_rate", 1.5),
        ("window", -1),
        ("window", math.nan),
        ("min_calls", 0),
        ("open_for", 0),
        ("slow_call", -1.0),
        ("slow_call", 20.0),  # above the 10 s timeout: a timeout already
        ("probe_calls", 0),
    ],
)
def test_thresholds_out_of_range_are_refused_at_registration(setting: str, value: Any) -> None:
    """app.dependency raises ConfigError naming the bad setting; nothing is registered."""
    app = App("memory://")
    with pytest.raises(ConfigError) as info:
        app.dependency(DEP, **{setting: value})
    assert info.value.setting == setting
    assert DEP not in app.dependencies


@pytest.mark.parametrize("name", ["", "payments:api", "pay ments", "x" * 65, 42])
def test_bad_dependency_names_are_refused(name: Any) -> None:
    """Names are 1-64 of A-Z a-z 0-9 _ . -: they are part of lease names."""
    with pytest.raises(InvalidInputError, match="dependency name"):
        App("memory://").dependency(name)


@pytest.mark.parametrize(
    ("settings", "again"),
    [({}, {}), ({"timeout": 5}, {"timeout": 5}), ({"timeout": 5}, {"timeout": 6})],
    ids=["the defaults twice", "the same settings twice", "other settings"],
)
def test_a_name_is_registered_once(settings: dict[str, Any], again: dict[str, Any]) -> None:
    """A second registration of a name is refused, as a task's is, even with the same
    settings: two parts of an app naming different services alike would share one
    breaker, and with equal settings (the defaults) nothing said so. The first stays."""
    app = App("memory://")
    first = app.dependency(DEP, **settings)
    with pytest.raises(
        InvalidInputError, match=f"a dependency named '{DEP}' is already registered"
    ):
        app.dependency(DEP, **again)
    assert app.dependencies[DEP] is first
    assert list(app.dependencies) == [DEP]


def test_depends_on_takes_a_list_of_valid_names() -> None:
    """A bare string is refused (it would be a list of letters), bad names too; the
    list is kept once each, in order."""
    app = App("memory://")
    with pytest.raises(ConfigError) as info:
        app.task(name="t.dep_str", depends_on="payments-api")(lambda ctx: None)
    assert info.value.setting == "depends_on"
    with pytest.raises(InvalidInputError, match="depends_on"):
        app.task(name="t.dep_bad", depends_on=["a:b"])(lambda ctx: None)

    @app.task(name="t.dep_ok", depends_on=["b", "a", "b"])
    def ok(ctx: JobContext) -> None: ...

    assert app.tasks["t.dep_ok"].depends_on == ("b", "a")


async def test_an_unknown_name_in_depends_on_stops_the_worker_at_start() -> None:
    """Checked when the worker starts (registration order is free): ConfigError names
    the task and the dependency, before the store is touched."""
    app = App("memory://")
    app.dependency("search")

    @app.task(name="t.dep_unknown", depends_on=["payments-api"])
    def charge(ctx: JobContext) -> None: ...

    with pytest.raises(ConfigError) as info:
        await Worker(app, FAST).run()
    assert info.value.setting == "depends_on"
    assert "task 't.dep_unknown' depends on 'payments-api'" in str(info.value)
    assert "registered: search" in str(info.value)


# -- workers ------------------------------------------------------------------------------


def dep_app(**settings: Any) -> tuple[App, Store]:
    app = App("memory://")
    options = {"timeout": 1.0, "min_calls": 3, "window": 10.0, "open_for": 30.0}
    app.dependency(DEP, **(options | settings))
    return app, app.open_store()


async def hold_open(store: Store, seconds: float = 30.0) -> None:
    """Open the shared breaker as another worker would."""
    assert await store.resource_lease_acquire(resource=OPEN_LEASE, owner="other", ttl=seconds)


async def test_an_unknown_name_in_ctx_dependency_fails_the_job_naming_it() -> None:
    """A handler asking for an unregistered dependency fails for good, saying which."""
    app, store = dep_app()

    @app.task(name="t.dep_typo")
    async def typo(ctx: JobContext) -> None:
        async with ctx.dependency("payment-api"):
            pass

    jid = await app.enqueue_async("t.dep_typo", store=store)
    async with running(Worker(app, FAST)):
        await eventually_async(lambda: _state_is(store, jid, JobState.DEAD), "the job to go dead")
    job = await store.job_get(job_id=jid)
    assert "unknown dependency 'payment-api' (registered: payments-api)" in (job.last_error or "")


async def _state_is(store: Store, jid: int, state: JobState) -> bool:
    return (await store.job_get(job_id=jid)).state is state


async def test_another_workers_open_breaker_defers_jobs_unrun_with_attempts_intact() -> None:
    """Two workers on one store: A's calls fail until its breaker opens; B then gives
    back every job of a task that depends on the dependency, without running it: no
    attempt spent, nothing dead, each due when the breaker's open time ends, and B's
    concurrency limit and error window untouched."""
    app, store = dep_app()
    ran: list[int] = []

    @app.task(name="t.dep_fails", queue="a", depends_on=[DEP], max_attempts=50, retry=NO_BACKOFF)
    async def fails(ctx: JobContext) -> None:
        async with ctx.dependency(DEP):
            raise ConnectionError("connection refused")

    @app.task(name="t.dep_charge", queue="b", depends_on=[DEP])
    async def charge(ctx: JobContext) -> None:
        ran.append(ctx.job_id)

    a = Worker(app, dataclasses.replace(FAST, queues=("a",)), worker_id="wa")
    b = Worker(app, dataclasses.replace(FAST, queues=("b",)), worker_id="wb")
    async with running(a), running(b):
        for _ in range(3):
            await app.enqueue_async("t.dep_fails", store=store)
        await eventually_async(lambda: _open_in(store), "A's breaker to open in the store")
        opened = time.time()
        ids = [await app.enqueue_async("t.dep_charge", store=store) for _ in range(5)]
        await eventually(lambda: b.counters.deferred == 5, "B to defer the five jobs")
        assert b.counters.started == 0
        assert b.concurrency_limit == FAST.concurrency
        assert b._errors.count(b.clock.monotonic()) == 0
    assert ran == []
    for jid in ids:
        job = await store.job_get(job_id=jid)
        assert (job.state, job.attempt) == (JobState.SCHEDULED, 0)
        assert job.run_at == pytest.approx(opened + 30.0, abs=2.0)
    failing = await store.jobs_list(state=JobState.DEAD, limit=10)
    assert failing == []


async def _open_in(store: Store) -> bool:
    shared = read_shared(await store.resource_leases_list(), await store.store_time())
    return DEP in shared and shared[DEP].state is BreakerState.OPEN


async def test_one_probe_at_a_time_then_recovery_closes_every_worker() -> None:
    """The shared breaker turns half-open with jobs waiting on two workers: exactly one
    call is made until that trial has succeeded, then every job runs, each on its first
    attempt, and both workers' breakers end closed."""
    app, store = dep_app(open_for=0.5)
    spans: list[tuple[float, float]] = []

    @app.task(name="t.dep_slow_ok", depends_on=[DEP])
    async def slow_ok(ctx: JobContext) -> None:
        async with ctx.dependency(DEP):
            start = time.monotonic()
            await asyncio.sleep(0.2)
            spans.append((start, time.monotonic()))

    await hold_open(store, 0.5)
    ids = [await app.enqueue_async("t.dep_slow_ok", store=store) for _ in range(12)]
    a = Worker(app, FAST, worker_id="wa")
    b = Worker(app, FAST, worker_id="wb")
    async with running(a), running(b):
        for jid in ids:
            await eventually_async(
                lambda jid=jid: _state_is(store, jid, JobState.SUCCEEDED), f"job {jid} to succeed"
            )
        await eventually(
            lambda: all(w._board.state(DEP) is BreakerState.CLOSED for w in (a, b)),
            "both breakers to close",
        )
    first_end = min(end for _, end in spans)
    assert sum(start < first_end for start, _ in spans) == 1
    assert a.counters.deferred + b.counters.deferred > 0
    for jid in ids:
        assert (await store.job_get(job_id=jid)).attempt == 1


async def test_dependency_open_error_in_a_handler_gives_the_job_back_after_the_delay() -> None:
    """A task that calls ctx.dependency without declaring it runs, and its call is
    refused: the job is released (attempt refunded) to run when the breaker's open time
    ends; the worker's limiter and error window do not count it."""
    app, store = dep_app()
    calls: list[int] = []

    @app.task(name="t.dep_undeclared")
    async def undeclared(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        async with ctx.dependency(DEP):
            pass

    await hold_open(store, 30.0)
    jid = await app.enqueue_async("t.dep_undeclared", store=store)
    worker = Worker(app, FAST)
    async with running(worker):
        await eventually(lambda: worker.counters.released == 1, "the job to be given back")
    job = await store.job_get(job_id=jid)
    assert calls == [1]
    assert (job.state, job.attempt, job.error_class) == (JobState.SCHEDULED, 0, "coordination")
    assert job.run_at == pytest.approx(time.time() + 30.0, abs=3.0)
    assert "DependencyOpenError" in (job.last_error or "")
    assert worker.concurrency_limit == FAST.concurrency
    assert worker._errors.count(worker.clock.monotonic()) == 0


async def test_dependency_failures_shrink_the_limit_but_do_not_pause_the_worker() -> None:
    """Jobs failing from their dependency's timeouts spend attempts and shrink the
    concurrency limit, but stay out of the error window (the breaker pauses what needs
    the dependency); the same failure outside ctx.dependency still counts there."""
    app, store = dep_app(timeout=0.02, min_calls=1000)

    @app.task(name="t.dep_hangs", max_attempts=1)
    async def hangs(ctx: JobContext) -> None:
        try:
            async with ctx.dependency(DEP):
                await asyncio.sleep(1)
        except TimeoutError as exc:
            raise RuntimeError("payment failed") from exc

    @app.task(name="t.dep_plain_fail", max_attempts=1)
    async def plain(ctx: JobContext) -> None:
        raise ConnectionError("refused")

    worker = Worker(app, FAST)
    ids = [await app.enqueue_async("t.dep_hangs", store=store) for _ in range(4)]
    async with running(worker):
        for jid in ids:
            await eventually_async(lambda jid=jid: _state_is(store, jid, JobState.DEAD), "dead")
        assert worker.concurrency_limit < FAST.concurrency
        assert worker._errors.count(worker.clock.monotonic()) == 0
        other = await app.enqueue_async("t.dep_plain_fail", store=store)
        await eventually_async(lambda: _state_is(store, other, JobState.DEAD), "dead")
        assert worker._errors.failures(worker.clock.monotonic()) == 1


async def test_a_sync_call_past_its_timeout_is_counted_not_interrupted() -> None:
    """`with ctx.dependency()` in a sync handler: the call runs to its end and the job
    succeeds, but the breaker counts a timeout."""
    app, store = dep_app(timeout=0.05)
    heard: list[events.Event] = []

    @app.task(name="t.dep_sync")
    def slow(ctx: JobContext) -> str:
        with ctx.dependency(DEP):
            time.sleep(0.1)
        return ctx.dependency(DEP).call(lambda: "quick")

    jid = await app.enqueue_async("t.dep_sync", store=store)
    events.add_hook(heard.append)
    try:
        async with running(Worker(app, FAST)):
            await eventually_async(
                lambda: _state_is(store, jid, JobState.SUCCEEDED), "the job to succeed"
            )
    finally:
        events.remove_hook(heard.append)
    outcomes = [e.outcome for e in heard if isinstance(e, events.DependencyCall)]
    assert outcomes == ["timeout", "ok"]


async def test_a_sync_call_refuses_an_async_callee() -> None:
    """`ctx.dependency(...).call(fn)` in a sync handler with an async ``fn`` got a
    coroutine back that never ran, and the job went on as if it had. It is refused; an
    awaitable handed back is not a failure of the dependency for its breaker."""
    app, store = dep_app(timeout=5)
    heard: list[events.Event] = []
    ran: list[int] = []

    async def fetch() -> int:
        ran.append(1)
        return 1

    @app.task(name="t.dep_sync_async", max_attempts=1)
    def call(ctx: JobContext) -> int:
        return ctx.dependency(DEP).call(fetch)

    @app.task(name="t.dep_sync_awaitable", max_attempts=1)
    def returns(ctx: JobContext) -> Any:
        return ctx.dependency(DEP).call(lambda: fetch())

    ids = [
        await app.enqueue_async(t, store=store)
        for t in ("t.dep_sync_async", "t.dep_sync_awaitable")
    ]
    events.add_hook(heard.append)
    try:
        async with running(Worker(app, FAST)):
            for jid in ids:
                await eventually_async(lambda jid=jid: _state_is(store, jid, JobState.DEAD), "dead")
    finally:
        events.remove_hook(heard.append)
    for jid in ids:
        job = await store.job_get(job_id=jid)
        assert "NotSupportedError" in (job.last_error or ""), job
        assert f"ctx.dependency({DEP!r}).call(...) in a sync handler" in (job.last_error or "")
    assert ran == []
    outcomes = [e.outcome for e in heard if isinstance(e, events.DependencyCall)]
    assert outcomes == ["ok"], outcomes  # the lambda's quick return: not a failure


async def test_an_async_call_is_cancelled_at_its_timeout_and_the_attempt_retried() -> None:
    """`async with ctx.dependency()`: the block is cancelled at the dependency's timeout
    and raises TimeoutError naming it; the attempt is spent and retried, like any
    timeout, and the limiter hears of a timeout."""
    app, store = dep_app(timeout=0.05)

    @app.task(name="t.dep_async", max_attempts=2, retry=NO_BACKOFF)
    async def slow(ctx: JobContext) -> None:
        async with ctx.dependency(DEP):
            await asyncio.sleep(5 if ctx.attempt == 1 else 0)

    jid = await app.enqueue_async("t.dep_async", store=store)
    started = time.monotonic()
    async with running(Worker(app, FAST)):
        await eventually_async(
            lambda: _state_is(store, jid, JobState.SUCCEEDED), "the retry to succeed"
        )
    assert time.monotonic() - started < 3
    (first, _) = await store.job_attempts(job_id=jid)
    assert "dependency 'payments-api' did not answer within 0.05s" in (first.error or "")


async def test_worker_metrics_count_calls_timeouts_and_breaker_states() -> None:
    """The worker metrics follow DependencyCall and BreakerChanged."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    metrics(events.DependencyCall("w", DEP, "timeout", 1.0))
    metrics(events.DependencyCall("w", DEP, "rejected", 0.0))
    metrics(events.BreakerChanged("w", DEP, "closed", "open"))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("tokenline_dependency_calls_total", dependency=DEP, outcome="timeout") == 1
    assert value("tokenline_dependency_calls_total", dependency=DEP, outcome="rejected") == 1
    assert value("tokenline_dependency_timeouts_total", dependency=DEP) == 1
    assert value("tokenline_breaker_state", dependency=DEP, state="open") == 1
    assert value("tokenline_breaker_state", dependency=DEP, state="closed") == 0


async def test_the_exporter_and_status_show_the_shared_breaker(clock: FakeClock) -> None:
    """The store-wide view: tokenline_breaker_open is 1 while the open lease is held;
    status reports each registered dependency as open (until when), probing or closed."""
    store = MemoryStore(clock=clock)
    await hold_open(store, 30.0)
    collector = StoreCollector(store, max_age=0, clock=clock)
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        sample = registry.get_sample_value("tokenline_breaker_open", {"dependency": DEP})
        assert sample == 1
        report = await _status(store, 5.0, [DEP, "search"])
        # The dependency is the failing channel, and only it: the store's are ok.
        assert {name: ch["ok"] for name, ch in report["channels"].items()} == {
            "broker": True,
            "leases": True,
            "ledger": True,
        }
        assert report["dependencies"] == {
            DEP: {"state": "open", "open_until": clock.now() + 30.0, "prober": None},
            "search": {"state": "closed", "open_until": None, "prober": None},
        }
        clock.advance(31.0)
        assert registry.get_sample_value("tokenline_breaker_open", {"dependency": DEP}) == 0
        report = await _status(store, 5.0, [DEP])
        assert report["dependencies"][DEP]["state"] == "half_open"
    finally:
        collector.close()
