"""The worker against the in-memory store: outcomes, shutdown, and fencing of a zombie.

The worker's loops run on real asyncio time, so these tests use small intervals and
generous ``asyncio.wait_for`` deadlines, and never assert on durations. Lease validity
follows ``app.clock``: a FakeClock there freezes the worker's own view of its leases, so
the store-side token check can be exercised apart from the local self-fencing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from sabotage import StateOnlyMemoryStore
from tokenline import (
    App,
    Decision,
    ErrorClass,
    FakeClock,
    Job,
    JobCancelled,
    JobContext,
    JobState,
    LeaseExpiredError,
    Permanent,
    Retry,
    RetryPolicy,
    StoreError,
    StoreUnavailableError,
    TokenlineError,
    Worker,
    WorkerSettings,
    WorkerState,
    events,
)
from tokenline._jobs import ClaimedJob, Finish, NewJob, Outcome
from tokenline.stores import MemoryStore, Store
from tokenline.worker import completer

#: Deadline for anything a test waits on; a healthy run takes a small fraction of it.
DEADLINE = 10.0

#: Small intervals so the loops turn quickly. renew_interval is kept below lease_ttl / 3
#: (see test_config: exactly a third is refused for decimal fractions).
FAST = WorkerSettings(
    lease_ttl=0.6,
    renew_interval=0.15,
    poll_interval=0.02,
    rescue_interval=0.1,
    concurrency=4,
)

#: For zombie tests: no renewal or rescue fires during the test, so the only thing that
#: can refuse the worker is its commit.
QUIET = WorkerSettings(
    lease_ttl=30.0,
    renew_interval=10.0,
    poll_interval=0.02,
    rescue_interval=10.0,
    concurrency=1,
)

#: Retries come back at once instead of after seconds of backoff.
NO_BACKOFF = RetryPolicy(base=0.001, cap=0.001)

StateLog = list[WorkerState]


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[StateLog]:
    """Run ``worker`` in the background, recording every state it enters; stop it after."""
    states: StateLog = []
    worker.on_state_change = lambda old, new, reason: states.append(new)
    task = asyncio.create_task(worker.run(), name="test-worker")
    try:
        yield states
    finally:
        if not task.done():
            worker.request_shutdown()
            worker.request_shutdown()  # the second request stops at once
        await asyncio.wait_for(task, DEADLINE)


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Wait until ``predicate()`` holds, failing with ``what`` after the deadline."""

    async def poll() -> None:
        # Polling: the worker exposes no event for these conditions.
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(poll(), DEADLINE)
    except TimeoutError:
        pytest.fail(f"timed out waiting until {what}")


async def eventually_async(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait until ``await predicate()`` holds, failing with ``what`` after the deadline."""

    async def poll() -> None:
        # Polling: the store exposes no event for these conditions.
        while not await predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), DEADLINE)
    except TimeoutError:
        pytest.fail(f"timed out waiting until {what}")


async def job_in(store: Store, job_id: int, *states: JobState) -> Job:
    """Wait until the job reaches one of ``states`` and return it."""

    async def poll() -> Job:
        while True:
            job = await store.job_get(job_id=job_id)
            if job.state in states:
                return job
            await asyncio.sleep(0.005)

    try:
        return await asyncio.wait_for(poll(), DEADLINE)
    except TimeoutError:
        job = await store.job_get(job_id=job_id)
        pytest.fail(f"job {job_id} stayed {job.state.value}, expected one of {states}")


def state_of(worker: Worker) -> WorkerState:
    """The worker's state, read afresh (its methods change it behind a type checker's back)."""
    return worker.state


async def outcomes(store: Store, job_id: int) -> list[str | None]:
    """The recorded outcome of each attempt of a job, oldest first."""
    return [a.outcome for a in await store.job_attempts(job_id=job_id)]


@pytest.fixture
def app() -> App:
    """An in-memory app on the real clock."""
    return App("memory://")


@pytest.fixture
def store(app: App) -> Store:
    """The app's (shared) in-memory store."""
    return app.open_store()


# -- outcomes -------------------------------------------------------------------------------


async def test_job_succeeds_and_worker_returns_to_ready(app: App, store: Store) -> None:
    """A successful job is committed as succeeded and the worker goes PROCESSING → READY."""
    seen: list[tuple[int, int, int, str]] = []

    @app.task(name="t.ok")
    async def ok(ctx: JobContext, a: int, *, b: str) -> None:
        seen.append((ctx.job_id, ctx.attempt, a, b))

    jid = await app.enqueue_async("t.ok", 7, kwargs={"b": "x"}, store=store)
    worker = Worker(app, FAST)
    async with running(worker) as states:
        job = await job_in(store, jid, JobState.SUCCEEDED)
        await eventually(lambda: worker.state is WorkerState.READY and bool(states), "READY")
        assert states[:2] == [WorkerState.PROCESSING, WorkerState.READY]
    assert seen == [(jid, 1, 7, "x")]
    assert job.attempt == 1
    assert job.lease_owner is None
    assert await outcomes(store, jid) == ["succeeded"]
    assert worker.counters.succeeded == 1
    assert worker.state is WorkerState.STOPPED


async def test_transient_failure_retries_then_goes_dead(app: App, store: Store) -> None:
    """A handler that keeps failing is retried up to max_attempts, then dead with the reason."""
    calls: list[int] = []

    @app.task(name="t.flaky", max_attempts=3, retry=NO_BACKOFF)
    async def flaky(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        raise ConnectionResetError("peer reset")

    jid = await app.enqueue_async("t.flaky", store=store)
    worker = Worker(app, FAST)
    async with running(worker):
        job = await job_in(store, jid, JobState.DEAD)
    assert calls == [1, 2, 3]
    assert job.attempt == 3
    assert job.error_class == "transient"
    assert job.last_error is not None
    assert "ConnectionResetError: peer reset" in job.last_error
    assert "attempt 3 of 3" in job.last_error
    assert await outcomes(store, jid) == ["retry", "retry", "dead"]
    assert (worker.counters.retried, worker.counters.dead) == (2, 1)


async def test_permanent_goes_dead_at_once(app: App, store: Store) -> None:
    """Permanent(reason) dead-letters the job on its first attempt, keeping the reason."""
    calls: list[int] = []

    @app.task(name="t.perm", max_attempts=5)
    async def perm(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        raise Permanent("order 7 does not exist")

    jid = await app.enqueue_async("t.perm", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert calls == [1]
    assert job.attempt == 1
    assert job.last_error == "order 7 does not exist"
    assert job.error_class == "permanent"


async def test_type_error_in_handler_is_dead_at_once(app: App, store: Store) -> None:
    """Arguments the handler cannot take (TypeError) dead-letter the job without retries.
    The app refuses such a job when it is enqueued; this one was stored as another
    version of the handler would have it (a rolling deploy), straight into the store."""

    @app.task(name="t.arity", max_attempts=5)
    async def arity(ctx: JobContext) -> None:
        return None

    (jid,) = await store.jobs_enqueue(
        jobs=[NewJob(queue="default", task="t.arity", args='{"args": [1, 2], "kwargs": {}}')]
    )
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert job.attempt == 1
    assert job.error_class == "permanent"
    assert job.last_error is not None
    assert job.last_error.startswith("TypeError")


_NOT_EXCEPTIONS: list[type[BaseException]] = [asyncio.CancelledError, GeneratorExit, SystemExit]


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize("raised", _NOT_EXCEPTIONS, ids=lambda t: t.__name__)
async def test_a_handler_raising_a_base_exception_fails_its_attempt_like_any_error(
    app: App, store: Store, kind: str, raised: type[BaseException]
) -> None:
    """CancelledError, GeneratorExit or SystemExit raised by the handler itself (nobody
    cancelled it) is that attempt's failure: committed at once with the handler's reason,
    not lost with the task so that the job waits for its lease to expire."""
    seen: list[BaseException] = []

    def classifier(exc: BaseException) -> ErrorClass:
        seen.append(exc)
        return ErrorClass.PERMANENT

    if kind == "async":

        @app.task(name="t.base", max_attempts=3, classifier=classifier)
        async def base_async(ctx: JobContext) -> None:
            raise raised("the handler's own")

    else:

        @app.task(name="t.base", max_attempts=3, classifier=classifier)
        def base_sync(ctx: JobContext) -> None:
            raise raised("the handler's own")

    jid = await app.enqueue_async("t.base", store=store)
    worker = Worker(app, FAST)
    async with running(worker):
        job = await job_in(store, jid, JobState.DEAD)
    assert await outcomes(store, jid) == ["dead"]
    assert job.last_error == f"{raised.__name__}: the handler's own"
    assert job.lease_expiries == 0
    assert [type(e) for e in seen] == [raised]  # the classifier sees what was raised
    assert worker.counters.fenced == 0


async def _body(ran: list[str]) -> None:
    ran.append("coroutine")


def _gen_body(ran: list[str]) -> Any:
    ran.append("generator")
    yield


async def _agen_body(ran: list[str]) -> Any:
    ran.append("async generator")
    yield


@pytest.mark.parametrize(
    ("kind", "returns", "said"),
    [
        ("sync", _body, "returned a coroutine without awaiting it"),
        ("async", _body, "returned a coroutine without awaiting it"),
        ("sync", _gen_body, "returned a generator"),
        ("async", _gen_body, "returned a generator"),
        ("sync", _agen_body, "returned an async generator"),
    ],
)
async def test_a_handler_that_returns_work_never_started_is_dead_not_succeeded(
    app: App, store: Store, kind: str, returns: Callable[[list[str]], Any], said: str
) -> None:
    """A handler that hands back a coroutine or generator instead of running it did none
    of its work: the job is dead with a reason saying so, never recorded as succeeded."""
    ran: list[str] = []
    if kind == "sync":

        @app.task(name="t.unrun", max_attempts=3)
        def unrun_sync(ctx: JobContext) -> Any:
            return returns(ran)

    else:

        @app.task(name="t.unrun", max_attempts=3)
        async def unrun_async(ctx: JobContext) -> Any:
            return returns(ran)

    jid = await app.enqueue_async("t.unrun", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD, JobState.SUCCEEDED)
    assert job.state is JobState.DEAD
    assert job.error_class == "permanent"
    assert job.last_error is not None
    assert said in job.last_error
    assert "'t.unrun'" in job.last_error
    assert ran == []


async def test_retry_with_zero_delay_retries_at_once(app: App, store: Store) -> None:
    """Retry(delay=0) runs the job again right away, overriding a long backoff policy."""
    calls: list[int] = []

    @app.task(name="t.again", retry=RetryPolicy(base=60.0, cap=60.0))
    async def again(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise Retry(delay=0, reason="not yet")

    jid = await app.enqueue_async("t.again", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.SUCCEEDED)
    assert calls == [1, 2]
    assert job.attempt == 2
    attempts = await store.job_attempts(job_id=jid)
    assert [a.outcome for a in attempts] == ["retry", "succeeded"]
    assert attempts[0].error == "not yet"
    assert attempts[1].token > attempts[0].token


async def test_coordination_error_releases_without_burning_an_attempt(
    app: App, store: Store
) -> None:
    """A handler failing with StoreUnavailableError gives the attempt back and runs again."""
    calls: list[int] = []

    @app.task(name="t.coord", max_attempts=1)
    async def coord(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        if len(calls) == 1:
            raise StoreUnavailableError("ledger unreachable")

    jid = await app.enqueue_async("t.coord", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.SUCCEEDED)
    # With max_attempts=1, a burned attempt would have made the failure final.
    assert calls == [1, 1]
    assert job.attempt == 1
    attempts = await store.job_attempts(job_id=jid)
    assert [a.outcome for a in attempts] == ["release", "succeeded"]
    assert attempts[0].error_class == "coordination"


@pytest.mark.parametrize("cause", ["store", "classifier"])
async def test_a_coordination_failure_runs_again_after_a_backoff_not_at_once(
    clock: FakeClock, cause: str
) -> None:
    """A job whose every run meets the same coordination failure (a ledger down while the
    broker answers, a classifier that calls every error coordination) is given back to
    run after the retry policy's delay, not at once: at once, it looped for ever, claimed
    and released as fast as the worker could. On a frozen clock it is not run again."""

    def everything_is_coordination(exc: BaseException) -> ErrorClass:
        return ErrorClass.COORDINATION

    app = App("memory://", clock=clock)
    store = app.open_store()
    calls: list[int] = []
    classifier = everything_is_coordination if cause == "classifier" else None

    @app.task(name="t.coord_loop", classifier=classifier)
    async def coord_loop(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        if cause == "store":
            raise StoreUnavailableError("ledger unreachable")
        raise ValueError("a bug the classifier calls coordination")

    jid = await app.enqueue_async("t.coord_loop", store=store)
    async with running(Worker(app, FAST)):
        await eventually_async(
            lambda: _outcome_is(store, jid, "release"), "the attempt was given back"
        )
        job = await store.job_get(job_id=jid)
        assert job.state is JobState.SCHEDULED
        assert job.run_at > clock.now()
        assert job.attempt == 0  # given back: no attempt spent
    assert calls == [1]


async def test_app_classifier_decides_for_the_worker() -> None:
    """The worker consults the app's classifier: a ValueError it calls permanent is dead at once."""
    app = App(
        "memory://",
        classifier=lambda exc: ErrorClass.PERMANENT if isinstance(exc, ValueError) else None,
    )
    store = app.open_store()
    calls: list[int] = []

    @app.task(name="t.classified", max_attempts=5, retry=NO_BACKOFF)
    async def classified(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        raise ValueError("bad row")

    jid = await app.enqueue_async("t.classified", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert calls == [1]
    assert job.error_class == "permanent"
    assert job.last_error == "ValueError: bad row"


class _Unprintable(Exception):
    """An exception whose message cannot be read: its ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no message for you")


@pytest.mark.parametrize("sync", [False, True])
async def test_an_exception_whose_message_cannot_be_read_still_ends_its_job(
    app: App, store: Store, sync: bool
) -> None:
    """A handler's exception whose ``__str__`` raises is retried and dead-lettered like
    any other, with its type as the reason: its job never stays running until its
    lease expires (the job's task used to die on the message)."""

    def fail(ctx: JobContext) -> None:
        raise _Unprintable

    async def fail_async(ctx: JobContext) -> None:
        raise _Unprintable

    app.task(name="t.unprintable", max_attempts=2, retry=NO_BACKOFF)(fail if sync else fail_async)
    jid = await app.enqueue_async("t.unprintable", store=store)
    worker = Worker(app, FAST)
    async with running(worker):
        job = await job_in(store, jid, JobState.DEAD)
    assert job.attempt == 2
    assert job.lease_expiries == 0
    assert job.last_error is not None
    assert job.last_error.startswith("_Unprintable: <str() of the exception raised>")
    assert await outcomes(store, jid) == ["retry", "dead"]


@pytest.mark.parametrize("verdict", ["raises", "exits", "interrupts", "junk"])
async def test_a_broken_classifier_leaves_the_defaults_to_decide(verdict: str) -> None:
    """A classifier that raises (even SystemExit or KeyboardInterrupt), or answers
    something that is no class, is logged and the default classes decide, naming the
    classifier's failure: the job is retried, then dead, and never left running until
    its lease expires; the worker lives on."""

    def broken(exc: BaseException) -> Any:
        if verdict == "raises":
            raise KeyError("classifier bug")
        if verdict == "exits":
            raise SystemExit(3)
        if verdict == "interrupts":
            raise KeyboardInterrupt
        return "permanent"  # a string, not ErrorClass.PERMANENT

    app = App("memory://", classifier=broken)
    store = app.open_store()

    @app.task(name="t.misclassified", max_attempts=2, retry=NO_BACKOFF)
    async def misclassified(ctx: JobContext) -> None:
        raise ConnectionResetError("peer reset")

    jid = await app.enqueue_async("t.misclassified", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert job.attempt == 2
    assert job.error_class == "transient"
    assert job.last_error is not None
    assert job.last_error.startswith("ConnectionResetError: peer reset (the classifier failed: ")
    assert await outcomes(store, jid) == ["retry", "dead"]


async def test_a_classifier_decision_with_a_bad_delay_is_a_classifier_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Decision whose delay is no number of seconds (altered after its checks) is
    logged as a failing classifier and the defaults decide: the worker runs on, and
    the job is retried, then dead, never left running."""

    def sloppy(exc: BaseException) -> Decision:
        decision = Decision(ErrorClass.TRANSIENT, "try later", 1.0)
        object.__setattr__(decision, "delay", "soon")
        return decision

    app = App("memory://", classifier=sloppy)
    store = app.open_store()

    @app.task(name="t.sloppy", max_attempts=2, retry=NO_BACKOFF)
    async def fails(ctx: JobContext) -> None:
        raise ConnectionResetError("peer reset")

    jid = await app.enqueue_async("t.sloppy", store=store)
    with caplog.at_level(logging.ERROR, logger="tokenline.worker"):
        async with running(Worker(app, FAST)):
            job = await job_in(store, jid, JobState.DEAD)
    assert await outcomes(store, jid) == ["retry", "dead"]
    assert job.last_error is not None
    assert "(the classifier failed: InvalidInputError" in job.last_error
    assert any("classifier failed" in r.getMessage() for r in caplog.records)


class _SoonPolicy(RetryPolicy):
    """A retry policy whose delay() answers a string."""

    def delay(self, attempt: int, rng: Any = None) -> float:
        return "soon"  # type: ignore[return-value]


async def test_a_retry_policy_answering_no_delay_does_not_stop_the_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A policy whose delay() is no number of seconds is logged, the default backoff
    decides, and the job is retried, then dead; the worker keeps running jobs."""
    app = App("memory://")
    store = app.open_store()

    @app.task(name="t.policy", max_attempts=2, retry=_SoonPolicy(0.001, 0.001))
    async def fails(ctx: JobContext) -> None:
        raise ConnectionResetError("peer reset")

    @app.task(name="t.after")
    async def after(ctx: JobContext) -> None:
        return None

    jid = await app.enqueue_async("t.policy", store=store)
    with caplog.at_level(logging.ERROR, logger="tokenline.worker"):
        async with running(Worker(app, FAST)):
            await job_in(store, jid, JobState.DEAD)
            later = await app.enqueue_async("t.after", store=store)
            await job_in(store, later, JobState.SUCCEEDED)
    assert await outcomes(store, jid) == ["retry", "dead"]
    assert any("retry policy" in r.getMessage() for r in caplog.records)


async def test_unknown_task_goes_dead(app: App, store: Store) -> None:
    """A stored job whose task this worker does not know is dead with "unknown task"."""
    app.task(name="t.known")(lambda ctx: None)
    (jid,) = await store.jobs_enqueue(
        jobs=[NewJob(queue="default", task="t.gone", args='{"args":[],"kwargs":{}}')]
    )
    worker = Worker(app, FAST)
    async with running(worker):
        job = await job_in(store, jid, JobState.DEAD)
    assert job.last_error is not None
    assert "unknown task 't.gone'" in job.last_error
    assert "t.known" in job.last_error
    assert worker.id in job.last_error
    assert job.error_class == "permanent"


@pytest.mark.parametrize(
    "payload",
    [
        "not json",
        "[1, 2]",
        '{"args": {"a": 1}, "kwargs": {}}',
        '{"args": [], "kwargs": []}',
        '{"args": [' + "[" * 100_000 + "]" * 100_000 + "]}",
    ],
    ids=["not-json", "not-object", "args-not-list", "kwargs-not-object", "nested-too-deep"],
)
async def test_malformed_payload_goes_dead(app: App, store: Store, payload: str) -> None:
    """A stored payload that is not {"args": [...], "kwargs": {...}} is dead without a call."""
    calls: list[int] = []

    @app.task(name="t.mal")
    async def mal(ctx: JobContext, *args: Any, **kwargs: Any) -> None:
        calls.append(ctx.attempt)

    (jid,) = await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t.mal", args=payload)])
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert calls == []
    assert job.last_error is not None
    assert job.last_error.startswith("malformed job payload")
    assert job.error_class == "permanent"


async def test_hard_timeout_cancels_async_handler_and_retries(app: App, store: Store) -> None:
    """An async handler over its task timeout is cancelled, retried, then dead with "timeout"."""
    cancelled: list[int] = []

    @app.task(name="t.slow", timeout=0.1, max_attempts=2, retry=NO_BACKOFF)
    async def slow(ctx: JobContext) -> None:
        try:
            await asyncio.sleep(DEADLINE * 10)
        except asyncio.CancelledError:
            cancelled.append(ctx.attempt)
            raise

    jid = await app.enqueue_async("t.slow", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert cancelled == [1, 2]
    assert job.last_error is not None
    assert "timeout" in job.last_error
    assert "attempt 2 of 2" in job.last_error
    attempts = await store.job_attempts(job_id=jid)
    assert [a.outcome for a in attempts] == ["retry", "dead"]
    assert attempts[0].error is not None
    assert "timeout" in attempts[0].error


async def test_hard_timeout_flags_sync_handler_through_ctx(app: App, store: Store) -> None:
    """A sync handler over its timeout sees JobCancelled from ctx.check(), and the job is dead."""
    raised: list[BaseException] = []
    stopped = threading.Event()

    @app.task(name="t.sync_slow", timeout=0.1, max_attempts=1)
    def sync_slow(ctx: JobContext) -> None:
        try:
            while True:
                ctx.check()
                time.sleep(0.005)
        except BaseException as exc:
            raised.append(exc)
            raise
        finally:
            stopped.set()

    jid = await app.enqueue_async("t.sync_slow", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
        await eventually(stopped.is_set, "the handler thread returned")
    assert job.last_error is not None
    assert "timeout" in job.last_error
    assert len(raised) == 1
    assert isinstance(raised[0], JobCancelled)
    # The handler is told why (it said "cancelled by the worker: None").
    assert "hard timeout: attempt ran longer than 0.1s" in str(raised[0]), raised[0]


async def test_threads_held_past_their_attempt_keep_jobs_from_the_pool_queue(
    app: App, store: Store
) -> None:
    """Sync handlers that run on past their hard timeout keep their pool threads: once
    they hold more than the pool has to spare, the worker claims no job it has no thread
    for. Before, such a job waited in the pool's queue with its timeout running, and went
    dead "after running longer than" its timeout without its handler ever starting."""
    release = threading.Event()
    ran: list[int] = []

    @app.task(name="t.stuck", timeout=0.1, max_attempts=1)
    def stuck(ctx: JobContext) -> None:
        release.wait(DEADLINE * 3)  # ignores ctx: its thread runs on after the timeout

    # A timeout a loaded machine can start a thread within, once one is free.
    @app.task(name="t.quick", timeout=1.0, max_attempts=1)
    def quick(ctx: JobContext) -> None:
        ran.append(ctx.job_id)

    # Concurrency 1: a pool of two threads, one to spare.
    settings = dataclasses.replace(FAST, concurrency=1)
    moves: list[tuple[int, int]] = []
    stuck_ids = [await app.enqueue_async("t.stuck", priority=10, store=store) for _ in range(2)]
    quick_id = await app.enqueue_async("t.quick", store=store)
    worker = Worker(app, settings)

    def heard(event: events.Event) -> None:
        if isinstance(event, events.ConcurrencyLimitChanged):
            moves.append((event.old, event.new))

    try:
        events.add_hook(heard)
        async with running(worker):
            for jid in stuck_ids:
                await job_in(store, jid, JobState.DEAD)
            await eventually(lambda: worker.concurrency_limit == 0, "no thread is left")
            # Long enough for the quick job's timeout to pass several times over, had it
            # been claimed and left waiting for a thread.
            await asyncio.sleep(3.0)
            waiting = await store.job_get(job_id=quick_id)
            assert (waiting.state, waiting.attempt) == (JobState.QUEUED, 0)
            release.set()
            job = await job_in(store, quick_id, JobState.SUCCEEDED, JobState.DEAD)
            assert (job.state, job.attempt, ran) == (JobState.SUCCEEDED, 1, [quick_id])
            await eventually(lambda: worker.concurrency_limit == 1, "the threads came back")
        # The metrics hear of each move (the gauge follows these events).
        assert moves == [(1, 0), (0, 1)]
    finally:
        events.remove_hook(heard)
        release.set()


async def test_an_async_handler_that_ignores_its_hard_timeout_is_abandoned(
    app: App, store: Store
) -> None:
    """A handler that catches every cancellation would run, and keep its lease renewed,
    for ever: call_timeout after its hard timeout it is closed where it waits, and the
    attempt fails with a timeout that says so."""
    cancels: list[int] = []
    closed = asyncio.Event()
    # Set once the test is over: a cancellation then ends the handler, so that if it
    # is not abandoned, the test fails instead of hanging the event loop's teardown.
    over = asyncio.Event()

    @app.task(name="t.stubborn", timeout=0.1, max_attempts=1)
    async def stubborn(ctx: JobContext) -> None:
        try:
            while True:
                try:
                    await asyncio.sleep(DEADLINE * 10)
                except asyncio.CancelledError:
                    cancels.append(1)  # and carries on
                    if over.is_set():
                        raise
        except GeneratorExit:
            closed.set()
            raise

    jid = await app.enqueue_async("t.stubborn", store=store)
    async with running(Worker(app, FAST)):
        try:
            job = await job_in(store, jid, JobState.DEAD)
        finally:
            over.set()
    assert closed.is_set()
    assert cancels  # it was cancelled, and caught it
    assert await outcomes(store, jid) == ["dead"]
    assert job.last_error is not None
    assert job.last_error.startswith("hard timeout: attempt ran longer than 0.1s")
    assert "abandoned" in job.last_error


async def test_an_async_handler_that_returns_after_its_hard_timeout_fails_with_it(
    app: App, store: Store
) -> None:
    """Catching the timeout's cancellation and returning does not turn an attempt that
    overran its hard timeout into a success."""

    @app.task(name="t.late", timeout=0.1, max_attempts=1)
    async def late(ctx: JobContext) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(DEADLINE * 10)

    jid = await app.enqueue_async("t.late", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD, JobState.SUCCEEDED)
    assert job.state is JobState.DEAD
    assert job.last_error is not None
    assert "hard timeout" in job.last_error
    assert "returned late" in job.last_error


async def test_a_stop_closes_a_handler_that_ignores_its_cancellation(
    app: App, store: Store
) -> None:
    """A stop cancels the handlers in flight; one that catches it is closed after
    call_timeout, so the worker stops and its job goes back to the queue."""
    started = asyncio.Event()
    closed = asyncio.Event()
    over = asyncio.Event()  # as above: a failure, not a hang, if it is not abandoned

    @app.task(name="t.deaf", timeout=DEADLINE * 10)
    async def deaf(ctx: JobContext) -> None:
        started.set()
        try:
            while not over.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(DEADLINE * 10)
        except GeneratorExit:
            closed.set()
            raise

    jid = await app.enqueue_async("t.deaf", store=store)
    worker = Worker(app, FAST)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(started.wait(), DEADLINE)
        worker.request_shutdown()
        worker.request_shutdown()  # the second request stops at once
        await asyncio.wait_for(asyncio.shield(task), DEADLINE)
    finally:
        over.set()
    assert closed.is_set()
    assert worker.state is WorkerState.STOPPED
    job = await job_in(store, jid, JobState.QUEUED)
    assert job.attempt == 0  # given back, attempt refunded


def gc_collect() -> None:
    """A garbage collection: a task that ended with an error nobody retrieved is then
    reported to the loop's exception handler."""
    import gc

    gc.collect()


def _collected(worker: Worker) -> Worker:
    """``worker``, after a garbage collection: a task that ended with an error nobody
    retrieved is reported (to the loop's exception handler) when it is collected."""
    import gc

    drainer = worker._drainer
    worker._drainer = None
    del drainer
    gc.collect()
    return worker


async def test_a_second_stop_during_the_drains_cancellation_gives_back_once(
    app: App, store: Store
) -> None:
    """The drain's timeout cancelled handlers that caught it, and while it waited for
    them a second stop came: the drain then fired its timeout in STOPPED (an
    InvalidTransitionError no one saw), and the stop's own cancellation gave the same
    jobs back again, which the store recorded as stale writes. Each job is now given
    back once, and the worker stops cleanly."""
    failures: list[BaseException] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: failures.append(context["exception"]))
    over = asyncio.Event()

    @app.task(name="t.stubborn", timeout=DEADLINE * 10)
    async def stubborn(ctx: JobContext) -> None:
        while not over.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.05)

    ids = [await app.enqueue_async("t.stubborn", store=store) for _ in range(2)]
    settings = dataclasses.replace(
        FAST, lease_ttl=6.0, renew_interval=0.5, drain_timeout=0.1, store_timeout=1.0
    )
    worker = Worker(app, settings)
    task = asyncio.create_task(worker.run())
    try:
        await eventually(
            lambda: worker.sync_handlers_running + len(worker._slots) == 2, "both running"
        )
        worker.request_shutdown()  # the drain: its timeout cancels, they catch it
        await eventually(
            lambda: any(s.cancel_reason == "drain timeout" for s in worker._slots.values()),
            "the drain's timeout to cancel the handlers",
        )
        worker.request_shutdown()  # the second request, while the drain waits for them
        await asyncio.wait_for(asyncio.shield(task), DEADLINE)
        await asyncio.sleep(0.1)  # the drain's task ends
        worker = _collected(worker)  # its error, if any, reported as never retrieved
    finally:
        over.set()
    assert failures == []
    assert worker.state is WorkerState.STOPPED
    assert worker.counters.stale_refused == 0
    assert (await store.stale_commits())[0] == 0
    for jid in ids:
        job = await job_in(store, jid, JobState.QUEUED)
        assert job.attempt == 0  # given back, attempt refunded


class _SlowReleases(MemoryStore):
    """Takes half a second to give jobs back (finishes with the RELEASE outcome)."""

    async def jobs_finish(self, *, finishes: Any) -> list[bool]:
        if any(f.outcome is Outcome.RELEASE for f in finishes):
            await asyncio.sleep(0.5)
        return await super().jobs_finish(finishes=finishes)


class _HeldRegistration(MemoryStore):
    """Holds a registration, once ``hold`` is set, until ``go`` is."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.held = asyncio.Event()
        self.go = asyncio.Event()

    async def worker_register(self, *, record: Any, ttl: float) -> Any:
        if self.hold:
            self.held.set()
            await self.go.wait()
        return await super().worker_register(record=record, ttl=ttl)


async def test_a_stop_while_a_fenced_worker_registers_again_ends_cleanly(app: App) -> None:
    """SIGTERM while a fenced worker registered again (an async handler had held the
    loop past its lease): the stop came first, and the registration's end then fired
    REREGISTERED in STOPPED, an InvalidTransitionError in a task nobody awaited, and
    left the stopped worker's membership live. It now ends quietly, deregistered."""
    store = _HeldRegistration()
    worker = Worker(app, FAST, store=store)
    async with running(worker):
        await eventually(lambda: worker.state is WorkerState.READY, "the worker to start")
        store.hold = True
        fencing = asyncio.create_task(worker._lease_lost("a test's lost lease"))
        await asyncio.wait_for(store.held.wait(), DEADLINE)
        assert worker.state is WorkerState.FENCED
        worker.request_shutdown()
        await eventually(lambda: worker.state is WorkerState.STOPPED, "the worker to stop")
        store.go.set()
        await asyncio.wait_for(fencing, DEADLINE)  # raises if the fencing failed
    (rec,) = await store.workers_list()
    assert rec.state == "stopped"


async def test_a_second_stop_waits_for_the_drains_give_back_under_way(app: App) -> None:
    """The drain's timeout was giving its jobs back when a second stop came: the process
    ended without waiting for that call, which its event loop's end cut off, and the
    jobs stayed leased to a stopped worker until their leases ran out, an expiry
    counted against each. The stop now waits for it (within the call timeout)."""
    store = _SlowReleases()
    over = asyncio.Event()

    @app.task(name="t.stubborn2", timeout=DEADLINE * 10)
    async def stubborn(ctx: JobContext) -> None:
        cancels = 0  # deaf to the drain's cancellation, not to the stop's
        while not over.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise

    ids = [await app.enqueue_async("t.stubborn2", store=store) for _ in range(2)]
    settings = dataclasses.replace(
        FAST, lease_ttl=6.0, renew_interval=0.5, drain_timeout=0.1, store_timeout=2.0
    )
    worker = Worker(app, settings, store=store)
    task = asyncio.create_task(worker.run())
    try:
        await eventually(lambda: len(worker._slots) == 2, "both running")
        worker.request_shutdown()
        await eventually(
            lambda: any(s.released for s in worker._slots.values()),
            "the drain to be giving the jobs back",
        )
        worker.request_shutdown()
        await asyncio.wait_for(asyncio.shield(task), DEADLINE)
        # As the end of the process's event loop would: whatever is left is cut off.
        if worker._drainer is not None:
            worker._drainer.cancel()
            await asyncio.gather(worker._drainer, return_exceptions=True)
    finally:
        over.set()
    for jid in ids:
        job = await store.job_get(job_id=jid)
        assert (job.state, job.attempt) == (JobState.QUEUED, 0)
    assert worker.counters.released == 2


async def test_a_ctx_kept_past_its_attempt_refuses(app: App, store: Store) -> None:
    """A JobContext used after its attempt ended (kept by a thread or a global) raises
    JobCancelled from check() and from the ledger calls that check first."""
    kept: list[JobContext] = []

    @app.task(name="t.keeps")
    async def keeps(ctx: JobContext) -> None:
        ctx.check()  # while the attempt runs: nothing to say
        kept.append(ctx)

    jid = await app.enqueue_async("t.keeps", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, jid, JobState.SUCCEEDED)
    (ctx,) = kept
    with pytest.raises(JobCancelled, match="the attempt is over"):
        ctx.check()
    with pytest.raises(JobCancelled, match="the attempt is over"):
        await ctx.effect_async("late", lambda: 1)
    assert await store.effects_list() == []


@pytest.mark.parametrize(
    "given", ["coroutine function", "lambda returning a coroutine", "async generator"]
)
async def test_a_sync_effect_refuses_an_async_callee_and_never_marks_its_key_done(
    app: App, store: Store, given: str
) -> None:
    """A sync handler's ctx.effect given an async callee created its coroutine, never
    awaited it, and recorded the key completed: the effect was lost for good (a retry
    said it "ran once"). It is refused, permanently, naming the fix; the key is left
    free (refused before it was taken) or failed (so a later attempt may run it)."""
    sent: list[str] = []

    async def send_email(to: str) -> str:
        sent.append(to)
        return "ok"

    async def emails(to: str) -> AsyncIterator[str]:
        sent.append(to)
        yield "ok"

    @app.task(name="t.sync_effect", max_attempts=3)
    def notify(ctx: JobContext, to: str) -> Any:
        if given == "coroutine function":
            return ctx.effect(f"email:{to}", send_email, to)
        if given == "async generator":
            return ctx.effect(f"email:{to}", emails, to)
        return ctx.effect(f"email:{to}", lambda: send_email(to))

    jid = await app.enqueue_async("t.sync_effect", "a@example.com", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert job.attempt == 1, job
    assert "NotSupportedError" in (job.last_error or ""), job
    assert "make the handler `async def` and await the call" in (job.last_error or "")
    assert sent == []
    records = await store.effects_list(key="email:a@example.com")
    if given in ("coroutine function", "async generator"):
        assert records == []
    else:
        assert [r.status.value for r in records] == ["failed"], records


@pytest.mark.parametrize("form", ["sync effect", "async effect", "sync call", "async call"])
async def test_a_callee_that_is_not_callable_is_refused_before_anything_is_taken(
    app: App, store: Store, form: str
) -> None:
    """``ctx.effect(key, 5)`` raised a bare TypeError after it had taken the key, which
    was then recorded failed "after one run" of a callee that never ran; a dependency's
    call counted it as a failure of the dependency. It is refused first, by name."""
    app.dependency("psp")

    @app.task(name="t.sync_bad", max_attempts=3)
    def sync_bad(ctx: JobContext) -> Any:
        if form == "sync effect":
            return ctx.effect("bad:1", 5)
        return ctx.dependency("psp").call(5)

    @app.task(name="t.async_bad", max_attempts=3)
    async def async_bad(ctx: JobContext) -> Any:
        if form == "async effect":
            return await ctx.effect("bad:1", 5)
        return await ctx.dependency("psp").call_async(5)

    task = "t.sync_bad" if form.startswith("sync") else "t.async_bad"
    jid = await app.enqueue_async(task, store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert job.attempt == 1, job
    assert "InvalidInputError" in (job.last_error or ""), job
    assert "needs a function to call, got int 5" in (job.last_error or ""), job
    assert await store.effects_list(key="bad:1") == []  # never taken


@pytest.mark.parametrize("callee", ["async", "sync"])
async def test_the_sync_dependency_call_in_an_async_handler_names_call_async(
    app: App, store: Store, callee: str
) -> None:
    """``ctx.dependency(name).call(...)`` in an async handler said "in a sync handler was
    given a coroutine function", or "`with ctx.dependency()` would block the event
    loop": neither names the form to use. It now names ``call_async``."""
    app.dependency("psp")

    async def charge() -> int:
        return 1

    def charge_sync() -> int:
        return 1

    @app.task(name="t.wrong_form", max_attempts=3)
    async def wrong_form(ctx: JobContext) -> Any:
        return ctx.dependency("psp").call(charge if callee == "async" else charge_sync)

    jid = await app.enqueue_async("t.wrong_form", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
    assert job.attempt == 1, job
    assert "ctx.dependency('psp').call(...) is the sync form, for sync handlers; in an " in (
        job.last_error or ""
    )
    assert "await ctx.dependency('psp').call_async(...)" in (job.last_error or "")


async def test_a_job_that_stalls_its_worker_each_time_takes_no_other_job_to_the_dlq(
    app: App, store: Store
) -> None:
    """An async handler that blocked the loop past the lease, each time: every job
    claimed with it lost its lease with it, each time, and all went to the dead-letter
    queue, though none of them had run. A job one lost lease from the dead-letter queue
    now runs alone: only the staller goes there, and the others run."""
    ran: list[int] = []

    @app.task(name="t.staller")
    async def staller(ctx: JobContext) -> None:
        time.sleep(1.0)  # noqa: ASYNC251 - the blocking call under test: past the lease

    @app.task(name="t.innocent")
    def innocent(ctx: JobContext) -> None:
        ran.append(ctx.job_id)

    bad = await app.enqueue_async("t.staller", store=store)
    good = [await app.enqueue_async("t.innocent", store=store) for _ in range(3)]
    worker = Worker(app, dataclasses.replace(FAST, prefetch=0))
    async with running(worker):
        dead = await asyncio.wait_for(job_in(store, bad, JobState.DEAD), 60)
        done = [
            await asyncio.wait_for(job_in(store, j, JobState.SUCCEEDED, JobState.DEAD), 60)
            for j in good
        ]
    assert [j.state for j in done] == [JobState.SUCCEEDED] * 3, [j.last_error for j in done]
    assert dead.lease_expiries == dead.max_lease_expiries
    assert "lost its lease" in (dead.last_error or "")
    assert sorted(set(ran)) == good
    # Claimed beside the staller, they lost leases with it, but never their last.
    assert all(0 < j.lease_expiries < j.max_lease_expiries for j in done), done


async def test_a_job_to_run_alone_waits_for_a_worker_with_nothing_else_running(
    app: App, store: Store
) -> None:
    """A job one lost lease from the dead-letter queue waited, claimed, on a worker
    still running another job: when that job killed the worker, the waiting one lost
    its last lease without having run. It is given back instead, and the worker claims
    nothing until its running job is over; then it runs that job alone, and the next."""
    events_seen: list[str] = []
    long_may_end = asyncio.Event()

    @app.task(name="t.long")
    async def long(ctx: JobContext) -> None:
        events_seen.append("long started")
        await long_may_end.wait()
        events_seen.append("long ended")

    @app.task(name="t.suspect", max_lease_expiries=2)
    async def suspect(ctx: JobContext) -> None:
        events_seen.append("suspect started")
        await asyncio.sleep(0.05)
        events_seen.append("suspect ended")

    @app.task(name="t.plain")
    async def plain(ctx: JobContext) -> None:
        events_seen.append("plain started")

    sid = await app.enqueue_async("t.suspect", store=store)
    # Its first attempt's worker vanished: the lease it held expires, one of its two.
    await store.jobs_claim(owner="ghost", queues=["default"], limit=1, ttl=0.3)
    await app.enqueue_async("t.long", store=store)
    worker = Worker(app, dataclasses.replace(FAST, concurrency=4, prefetch=0))
    async with running(worker):
        await eventually(lambda: "long started" in events_seen, "the long job to start")
        await eventually_async(
            lambda: _released_once(store, sid), "the rescued job to be given back unrun"
        )
        pid = await app.enqueue_async("t.plain", store=store)
        await asyncio.sleep(0.3)  # several claim turns: nothing may start meanwhile
        assert events_seen == ["long started"]
        long_may_end.set()
        await job_in(store, pid, JobState.SUCCEEDED)
    assert events_seen == [
        "long started",
        "long ended",
        "suspect started",
        "suspect ended",
        "plain started",
    ]
    job = await store.job_get(job_id=sid)
    assert (job.state, job.lease_expiries) == (JobState.SUCCEEDED, 1)


async def _released_once(store: Store, job_id: int) -> bool:
    """Whether an attempt of ``job_id`` was given back unrun (released)."""
    return any(a.outcome == "release" for a in await store.job_attempts(job_id=job_id))


async def test_a_worker_that_cannot_start_threads_gives_its_job_back_and_stops(
    app: App, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker out of threads (or memory) went on claiming, and failed every sync job
    it took with "can't start new thread", an attempt spent on each, innocent jobs too.
    The job goes back unrun, nothing spent, and the worker stops with an error, for a
    supervisor to start it afresh."""

    @app.task(name="t.sync_job")
    def sync_job(ctx: JobContext) -> None:
        raise AssertionError("never runs: no thread")

    jid = await app.enqueue_async("t.sync_job", store=store)
    worker = Worker(app, FAST)

    def no_thread(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("can't start new thread")

    worker._pool.submit = no_thread  # type: ignore[method-assign]
    with (
        caplog.at_level(logging.ERROR, logger="tokenline.worker"),
        pytest.raises(TokenlineError, match="cannot start a thread for a sync handler"),
    ):
        await asyncio.wait_for(worker.run(), DEADLINE)
    job = await store.job_get(job_id=jid)
    assert (job.state, job.attempt) == (JobState.QUEUED, 0)
    (attempt,) = await store.job_attempts(job_id=jid)
    assert attempt.outcome == "release"
    assert "cannot start a thread" in caplog.text


async def test_an_async_handler_step_that_holds_the_loop_is_logged_and_counted(
    app: App, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A blocking call in an async handler holds the worker's whole event loop: its
    renewals, heartbeat and other jobs wait. The step is reported once per attempt,
    naming the job and the task, counted, and sent as a LoopHeld event."""
    seen: list[events.LoopHeld] = []

    def hook(event: events.Event) -> None:
        if isinstance(event, events.LoopHeld):
            seen.append(event)

    @app.task(name="t.blocks")
    async def blocks(ctx: JobContext) -> None:
        for _ in range(2):
            time.sleep(0.3)  # noqa: ASYNC251 - the blocking call under test
            await asyncio.sleep(0)

    jid = await app.enqueue_async("t.blocks", store=store)
    # A watchdog period of 0.1 s, and a lease that outlasts the steps' 0.6 s.
    worker = Worker(app, dataclasses.replace(FAST, lease_ttl=3.0, renew_interval=0.2))
    events.add_hook(hook)
    try:
        with caplog.at_level(logging.WARNING, logger="tokenline.worker"):
            async with running(worker):
                await job_in(store, jid, JobState.SUCCEEDED)
    finally:
        events.remove_hook(hook)
    # The two blocking steps; on a loaded machine a short step can pass 0.1 s too.
    held = worker.counters.loop_held
    assert held >= 2
    assert [(e.job_id, e.task, e.queue) for e in seen] == [(jid, "t.blocks", "default")] * held
    assert sum(e.seconds >= 0.3 for e in seen) == 2, seen
    said = [r.getMessage() for r in caplog.records if "held the event loop" in r.getMessage()]
    assert len(said) == 1, said
    assert f"job {jid} (t.blocks)" in said[0]
    assert f"{held} async handler steps held the event loop" in worker.counters.summary()


async def test_sync_handler_runs_in_a_worker_thread(app: App, store: Store) -> None:
    """A sync handler runs in the worker's thread pool, not on the event loop's thread."""
    threads: list[threading.Thread] = []

    @app.task(name="t.sync")
    def sync(ctx: JobContext) -> None:
        threads.append(threading.current_thread())

    jid = await app.enqueue_async("t.sync", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, jid, JobState.SUCCEEDED)
    (thread,) = threads
    assert thread is not threading.current_thread()
    assert thread.name.startswith("tokenline-job")


# -- shutdown -------------------------------------------------------------------------------


async def test_shutdown_drains_in_flight_job_then_stops(app: App, store: Store) -> None:
    """A first shutdown request lets the in-flight job finish and commit, then the worker stops."""
    started = asyncio.Event()
    finish = asyncio.Event()

    @app.task(name="t.drain")
    async def drain(ctx: JobContext) -> None:
        started.set()
        await finish.wait()

    jid = await app.enqueue_async("t.drain", store=store)
    worker = Worker(app, FAST)
    states: StateLog = []
    worker.on_state_change = lambda old, new, reason: states.append(new)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), DEADLINE)
    worker.request_shutdown()
    assert worker.state is WorkerState.DRAINING
    # A job that arrives while draining must not be taken, though slots are free.
    other = await app.enqueue_async("t.drain", store=store)
    await asyncio.sleep(0.1)  # several poll intervals: time for a wrong fetch to happen
    assert not task.done()
    finish.set()
    await asyncio.wait_for(task, DEADLINE)
    assert (await store.job_get(job_id=jid)).state is JobState.SUCCEEDED
    # Draining fetches nothing new: the second job was never claimed.
    untouched = await store.job_get(job_id=other)
    assert untouched.attempt == 0
    assert untouched.state is JobState.QUEUED
    assert states[-2:] == [WorkerState.DRAINING, WorkerState.STOPPED]
    assert state_of(worker) is WorkerState.STOPPED


@pytest.mark.parametrize(
    ("queues", "warned"), [(("default",), True), (("billing",), False), (("x", "billing"), False)]
)
async def test_a_worker_on_queues_no_task_uses_says_so(
    queues: tuple[str, ...], warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The Quick start's task is on `billing`: a worker started without --queues served
    `default`, idled while the jobs piled up, and said nothing. It now warns, naming
    the tasks' queues and the option; a worker that serves one of them does not."""
    store = MemoryStore()
    app = App("memory://")
    app.task(name="t.invoice", queue="billing")(lambda ctx: None)
    app.task(name="t.mail", queue="mail")(lambda ctx: None)
    worker = Worker(app, dataclasses.replace(FAST, queues=queues), store=store)
    with caplog.at_level("WARNING", logger="tokenline.worker"):
        async with running(worker):
            await eventually(lambda: worker.state is WorkerState.READY, "the worker to start")
    said = [r.getMessage() for r in caplog.records if "none of its app's tasks" in r.getMessage()]
    if warned:
        assert len(said) == 1, caplog.text
        assert "theirs: billing, mail" in said[0]
        assert "--queues billing,mail" in said[0]
    else:
        assert said == []


async def test_a_drain_is_reported_at_once_not_a_renew_interval_later(
    app: App, store: Store
) -> None:
    """`tokenline workers` showed a draining worker as ready, its job in flight, until
    its next heartbeat: up to renew_interval (10 s by default) after the SIGTERM or the
    `tokenline drain`. The drain's first heartbeat goes out at once."""
    started = asyncio.Event()
    finish = asyncio.Event()

    @app.task(name="t.long")
    async def long(ctx: JobContext) -> None:
        started.set()
        await finish.wait()

    await app.enqueue_async("t.long", store=store)
    worker = Worker(app, QUIET)  # renew_interval 10 s: no heartbeat of its own meanwhile
    async with running(worker):
        await asyncio.wait_for(started.wait(), DEADLINE)
        worker.request_shutdown()

        async def reported() -> bool:
            (rec,) = await store.workers_list()
            return rec.state == WorkerState.DRAINING.value and rec.in_flight == 1

        # Well under renew_interval: only the drain's own heartbeat can report it.
        async def within() -> None:
            while not await reported():  # noqa: ASYNC110
                await asyncio.sleep(0.01)

        await asyncio.wait_for(within(), QUIET.renew_interval / 2)
        finish.set()


async def test_second_shutdown_stops_at_once_and_releases_job(app: App, store: Store) -> None:
    """A second shutdown request cancels the handler and gives the job back, attempt refunded."""
    started = asyncio.Event()
    cancelled: list[bool] = []

    @app.task(name="t.stuck")
    async def stuck(ctx: JobContext) -> None:
        started.set()
        try:
            await asyncio.sleep(DEADLINE * 10)
        except asyncio.CancelledError:
            cancelled.append(ctx.cancelled)
            raise

    jid = await app.enqueue_async("t.stuck", store=store)
    worker = Worker(app, FAST)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), DEADLINE)
    worker.request_shutdown()
    assert state_of(worker) is WorkerState.DRAINING
    worker.request_shutdown()
    assert state_of(worker) is WorkerState.STOPPED
    await asyncio.wait_for(task, DEADLINE)
    job = await store.job_get(job_id=jid)
    assert job.state is JobState.QUEUED
    assert job.attempt == 0
    assert job.lease_owner is None
    assert cancelled == [True]
    assert await outcomes(store, jid) == ["release"]
    assert worker.counters.released == 1


async def test_shutdown_requested_right_after_start_stops_the_worker(app: App) -> None:
    """request_shutdown() issued before the worker's loop has started still stops it."""
    worker = Worker(app, FAST)
    task = asyncio.create_task(worker.run())
    worker.request_shutdown()
    await asyncio.wait_for(task, DEADLINE)
    assert worker.state is WorkerState.STOPPED


class _AnswerLate(MemoryStore):
    """A store whose claims, once armed, take their jobs and then answer only after
    ``delay`` seconds: the answer of a committed claim still on its way back."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.armed = False
        self.taken = asyncio.Event()

    async def jobs_claim(self, **kwargs: Any) -> list[ClaimedJob]:
        claimed = await super().jobs_claim(**kwargs)
        if self.armed and claimed:
            self.taken.set()
            await asyncio.sleep(self.delay)
        return claimed


@pytest.mark.parametrize("requests", [1, 2])
async def test_a_stop_never_strands_the_jobs_of_a_claim_in_flight(requests: int) -> None:
    """An idle worker asked to stop while its claim's answer is on its way (the store
    has already leased it the jobs) gives those jobs back unrun: they are queued again
    at once, no attempt spent and no lease expiry counted, instead of staying leased to
    a stopped worker until the lease runs out. So with one request or two (stop now)."""
    store = _AnswerLate(delay=0.3)
    app = App("memory://")
    ran: list[int] = []

    @app.task(name="t.in_flight")
    async def handler(ctx: JobContext) -> None:
        ran.append(ctx.attempt)

    settings = dataclasses.replace(QUIET, lease_ttl=30.0)
    worker = Worker(app, settings, store=store)
    task = asyncio.create_task(worker.run())
    await eventually(lambda: worker.state is WorkerState.READY and worker.liveness()[0], "start")
    store.armed = True
    jid = await app.enqueue_async("t.in_flight", store=store)
    await asyncio.wait_for(store.taken.wait(), DEADLINE)
    for _ in range(requests):
        worker.request_shutdown()
    await asyncio.wait_for(task, DEADLINE)
    job = await store.job_get(job_id=jid)
    assert ran == []
    assert job.state is JobState.QUEUED, f"stranded: {job.state.value}, owner {job.lease_owner}"
    assert (job.attempt, job.lease_expiries, job.lease_owner) == (0, 0, None)
    assert await outcomes(store, jid) == ["release"]


class _ClaimsFail(MemoryStore):
    """A store whose claims, once armed, fail with a store error."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.failed = asyncio.Event()

    async def jobs_claim(self, **kwargs: Any) -> list[ClaimedJob]:
        if self.armed:
            self.failed.set()
            raise StoreError("the broker is unreachable")
        return await super().jobs_claim(**kwargs)

    async def wait_for_jobs(self, *, queues: Sequence[str], timeout: float) -> None:  # noqa: ASYNC109
        await asyncio.sleep(0.01)  # as an enqueue's notification would wake it


async def test_a_stop_after_a_failed_claim_does_not_wait_for_the_claim_to_settle() -> None:
    """The pause after a failed claim is not a claim in flight: a stop then goes ahead at
    once, rather than waiting up to the call timeout (here twice the test's deadline)
    for a claim that has already answered."""
    store = _ClaimsFail()
    app = App("memory://")
    settings = dataclasses.replace(QUIET, poll_interval=60.0, store_timeout=2 * DEADLINE)
    worker = Worker(app, settings, store=store)
    task = asyncio.create_task(worker.run())
    await eventually(lambda: worker.state is WorkerState.READY and worker.liveness()[0], "start")
    store.armed = True
    await asyncio.wait_for(store.failed.wait(), DEADLINE)
    await asyncio.sleep(0.05)  # the failure handled: the loop is in its pause
    worker.request_shutdown()
    await asyncio.wait_for(task, DEADLINE)
    assert worker.state is WorkerState.STOPPED


@pytest.mark.parametrize("requests", [1, 2])
async def test_a_stop_never_strands_the_jobs_claimed_with_a_finish(requests: int) -> None:
    """The same for the next job claimed in the request that finishes the last one: a
    stop while that answer is on its way records the finish and gives the next job
    back unrun, even a stop that cancels the handlers at once."""
    store = _AnswerLate(delay=0.3)
    app = App("memory://")
    release = asyncio.Event()
    ran: list[int] = []

    @app.task(name="t.with_finish")
    async def handler(ctx: JobContext) -> None:
        ran.append(ctx.job_id)
        await release.wait()

    first = await app.enqueue_async("t.with_finish", store=store)
    second = await app.enqueue_async("t.with_finish", store=store)
    worker = Worker(app, QUIET, store=store)  # one job at a time
    task = asyncio.create_task(worker.run())
    await eventually(lambda: ran == [first], "the first job to start")
    store.armed = True
    release.set()
    await asyncio.wait_for(store.taken.wait(), DEADLINE)
    for _ in range(requests):
        worker.request_shutdown()
    await asyncio.wait_for(task, DEADLINE)
    assert ran == [first]
    assert (await store.job_get(job_id=first)).state is JobState.SUCCEEDED
    job = await store.job_get(job_id=second)
    assert job.state is JobState.QUEUED, f"stranded: {job.state.value}, owner {job.lease_owner}"
    assert (job.attempt, job.lease_expiries, job.lease_owner) == (0, 0, None)
    assert await outcomes(store, second) == ["release"]


# -- fencing --------------------------------------------------------------------------------


def _zombie_setup(
    unsafe: bool,
) -> tuple[App, MemoryStore, list[ClaimedJob], list[int]]:
    """An app whose worker uses a store with its own clock, and a task that gets stolen.

    The app's FakeClock never moves, so the worker always trusts its lease; the store's
    clock jumps past the TTL inside the handler, the lease is rescued and re-claimed by
    ``other``: the worker is now a zombie that does not know it.
    """
    app = App("memory://", clock=FakeClock())
    store_clock = FakeClock()
    store = (StateOnlyMemoryStore if unsafe else MemoryStore)(clock=store_clock)
    stolen: list[ClaimedJob] = []
    rescued: list[int] = []

    @app.task(name="t.victim")
    async def victim(ctx: JobContext) -> None:
        store_clock.advance(QUIET.lease_ttl + 1)
        rescued.extend((await store.jobs_rescue()).requeued)
        stolen.extend(await store.jobs_claim(owner="other", queues=["default"], limit=1, ttl=3600))

    return app, store, stolen, rescued


async def test_zombie_commit_is_refused_and_worker_is_fenced() -> None:
    """A worker whose lease was stolen has its commit refused, goes FENCED, then READY again."""
    app, store, stolen, rescued = _zombie_setup(unsafe=False)
    (jid,) = await store.jobs_enqueue(jobs=[app.build_job("t.victim")])
    worker = Worker(app, QUIET, store=store)
    async with running(worker) as states:
        await eventually(lambda: WorkerState.FENCED in states, "the worker is fenced")
        await eventually(lambda: worker.state is WorkerState.READY, "the worker re-registers")
        i = states.index(WorkerState.FENCED)
        assert WorkerState.READY in states[i + 1 :]
        job = await store.job_get(job_id=jid)
    assert rescued == [jid]
    (theirs,) = stolen
    # The other owner still holds the job: the zombie's "succeeded" did not land.
    assert job.state is JobState.RUNNING
    assert job.lease_owner == "other"
    assert job.lease_token == theirs.lease.token
    assert worker.counters.succeeded == 0
    assert worker.counters.stale_refused >= 1
    _, refused = await store.stale_commits()
    mine = [(c.job_id, c.owner, c.operation) for c in refused if c.owner == worker.id]
    assert (jid, worker.id, "succeeded") in mine
    assert all(c.token < theirs.lease.token for c in refused if c.owner == worker.id)


async def test_without_store_fencing_the_zombie_commit_lands() -> None:
    """With the store's token check off, the same stale commit is accepted: the token protects."""
    app, store, stolen, _ = _zombie_setup(unsafe=True)
    (jid,) = await store.jobs_enqueue(jobs=[app.build_job("t.victim")])
    worker = Worker(app, QUIET, store=store)
    async with running(worker) as states:
        job = await job_in(store, jid, JobState.SUCCEEDED)
        assert WorkerState.FENCED not in states
    (theirs,) = stolen
    # The job was the other owner's, yet the zombie's outcome overwrote it.
    assert theirs.job.lease_owner == "other"
    assert job.state is JobState.SUCCEEDED
    assert worker.counters.succeeded == 1
    assert worker.counters.stale_refused == 0


#: The watchdog looks every 0.5 s; renewal (1 s) and rescue (10 s) come later, so the
#: watchdog is what notices a jump of the worker's clock.
WATCHED = WorkerSettings(
    lease_ttl=3.0, renew_interval=1.0, poll_interval=0.02, rescue_interval=10.0
)


async def test_watchdog_fences_and_cancels_async_handler(clock: FakeClock) -> None:
    """Once the worker's clock passes the TTL, the watchdog fences it and cancels the handler."""
    app = App("memory://", clock=clock)
    store = app.open_store()
    started = asyncio.Event()
    observed: list[tuple[int, bool]] = []

    @app.task(name="t.paused")
    async def paused(ctx: JobContext) -> None:
        if ctx.token > 1:
            return  # the rescued job runs again normally
        started.set()
        try:
            await asyncio.sleep(DEADLINE * 10)
        except asyncio.CancelledError:
            observed.append((ctx.attempt, ctx.cancelled))
            raise

    jid = await app.enqueue_async("t.paused", store=store)
    worker = Worker(app, WATCHED)
    async with running(worker) as states:
        await asyncio.wait_for(started.wait(), DEADLINE)
        clock.advance(WATCHED.lease_ttl + 0.5)  # as if the process had been paused
        await eventually(lambda: bool(observed), "the handler is cancelled")
        await eventually(lambda: worker.state is WorkerState.READY, "the worker re-registers")
        assert worker.counters.self_fenced >= 1
        # The fenced worker released nothing it no longer trusted: the job waits for rescue.
        assert (await store.job_get(job_id=jid)).state is JobState.RUNNING
        # Counted so, for the summary to add up: no succeeded, retried, dead or given back.
        assert worker.counters.lapsed == 1
        assert "0 given back, 1 left to their leases" in worker.counters.summary()
        assert await worker.maintenance_once()
        job = await job_in(store, jid, JobState.SUCCEEDED)
    assert observed == [(1, True)]
    assert WorkerState.FENCED in states
    assert WorkerState.READY in states[states.index(WorkerState.FENCED) + 1 :]
    # The lost lease gave the attempt back and counted as a lease expiry instead.
    assert (job.attempt, job.lease_expiries, job.lease_token) == (1, 1, 3)
    assert await outcomes(store, jid) == ["lease_expired", "succeeded"]


@pytest.mark.parametrize("guard", ["on", "bypassed"])
async def test_async_handler_takes_no_step_once_its_lease_is_untrusted(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch, guard: str
) -> None:
    """An async handler suspended while the worker's clock passes its lease never runs the
    statement after its await, and the worker fences; bypassed, the guard lets it run."""
    if guard == "bypassed":  # the control: the handler's coroutine is awaited as it is
        monkeypatch.setattr("tokenline.worker.worker.Guarded", lambda coro, *checks: coro)
    app = App("memory://", clock=clock)
    store = app.open_store()
    suspended = asyncio.Event()
    after: list[int] = []
    stopped: list[bool] = []

    @app.task(name="t.step")
    async def step(ctx: JobContext) -> None:
        if ctx.token > 1:
            return  # the rescued job runs again normally
        suspended.set()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            stopped.append(ctx.cancelled)
            raise
        after.append(ctx.token)

    jid = await app.enqueue_async("t.step", store=store)
    worker = Worker(app, WATCHED)
    async with running(worker) as states:
        async with asyncio.timeout(DEADLINE):  # no inner task: woken before the handler
            await suspended.wait()
        # The handler is suspended in its sleep, due to resume next, with no turn of the
        # watchdog in between: the same pass of the loop after a pause.
        assert (after, stopped) == ([], [])
        clock.advance(WATCHED.lease_ttl + 0.5)
        await eventually(lambda: bool(after or stopped), "the handler resumes or stops")
        await eventually(lambda: worker.state is WorkerState.READY, "the worker re-registers")
        assert await worker.maintenance_once()
        await job_in(store, jid, JobState.SUCCEEDED)
    first, second = await store.job_attempts(job_id=jid)
    if guard == "on":
        assert (after, stopped) == ([], [True])
    else:  # the step ran on a lease its worker no longer trusted
        assert (after, stopped) == ([first.token], [])
    assert WorkerState.FENCED in states
    assert (worker.counters.self_fenced, worker.counters.fenced) == (1, 1)
    assert worker.counters.succeeded == 1  # the second attempt only
    assert (first.outcome, second.outcome) == ("lease_expired", "succeeded")


async def test_sync_handler_ctx_refuses_once_lease_is_untrusted(clock: FakeClock) -> None:
    """A sync handler's ctx.check() raises LeaseExpiredError once its lease is past the TTL."""
    app = App("memory://", clock=clock)
    store = app.open_store()
    started = threading.Event()
    raised: list[BaseException] = []

    @app.task(name="t.sync_paused", max_lease_expiries=1)
    def sync_paused(ctx: JobContext) -> None:
        started.set()
        try:
            for _ in range(int(DEADLINE / 0.005)):
                ctx.check()
                time.sleep(0.005)
        except BaseException as exc:
            raised.append(exc)
            raise

    jid = await app.enqueue_async("t.sync_paused", store=store)
    worker = Worker(app, WATCHED)
    async with running(worker) as states:
        await eventually(started.is_set, "the handler started")
        clock.advance(WATCHED.lease_ttl + 0.5)
        await eventually(lambda: bool(raised), "ctx.check() refuses")
        await eventually(lambda: WorkerState.FENCED in states, "the worker is fenced")
        await eventually(lambda: worker.state is WorkerState.READY, "the worker re-registers")
        # Nothing was committed; at its lease-expiry limit, the rescue dead-letters it.
        assert (await store.job_get(job_id=jid)).state is JobState.RUNNING
        assert await worker.maintenance_once()
        job = await store.job_get(job_id=jid)
    assert isinstance(raised[0], LeaseExpiredError)
    assert job.state is JobState.DEAD
    assert job.error_class == "coordination"
    assert worker.counters.succeeded == 0
    assert worker.counters.dead == 0


async def test_reclaimed_job_does_not_orphan_its_earlier_attempt(clock: FakeClock) -> None:
    """After a pause, rescue and re-claim by the same worker, the old attempt is still cancelled.

    Models a worker resumed from a long pause: its lease was rescued meanwhile and its
    fetch loop claims the job again before the watchdog has looked at the clock.
    """
    app = App("memory://", clock=clock)
    store = app.open_store()
    started = asyncio.Event()
    cancelled: list[int] = []
    first_cancelled = asyncio.Event()
    second_done = asyncio.Event()

    @app.task(name="t.resumed")
    async def resumed(ctx: JobContext) -> None:
        if ctx.token > 1:
            second_done.set()
            return
        started.set()
        try:
            await asyncio.sleep(DEADLINE * 10)
        except asyncio.CancelledError:
            cancelled.append(ctx.attempt)
            first_cancelled.set()
            raise

    settings = WorkerSettings(
        lease_ttl=6.0, renew_interval=2.0, poll_interval=0.02, rescue_interval=10.0
    )
    jid = await app.enqueue_async("t.resumed", store=store)
    worker = Worker(app, settings)
    async with running(worker):
        await asyncio.wait_for(started.wait(), DEADLINE)
        clock.advance(settings.lease_ttl + 0.5)
        assert (await store.jobs_rescue()).requeued == [jid]  # by whichever leader runs it
        await asyncio.wait_for(second_done.wait(), DEADLINE)
        await job_in(store, jid, JobState.SUCCEEDED)
        # The watchdog looks every second; give it a few turns.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(first_cancelled.wait(), 3.0)
        assert cancelled == [1], "attempt 1 is still running, untracked by the worker"


# -- time -----------------------------------------------------------------------------------


class _SlowClaims(MemoryStore):
    """An in-memory store whose claims wait ``delay`` seconds before the store takes
    them, as a claim waiting for a lock does: the store's lease is fresh, but the worker
    has been waiting since it sent the request."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def jobs_claim(self, **kwargs: Any) -> list[ClaimedJob]:
        await asyncio.sleep(self.delay)
        return await super().jobs_claim(**kwargs)


async def test_slow_claim_starts_its_jobs_with_a_fresh_lease() -> None:
    """A claim that answers after its lease's trust window has passed (it waited for a
    lock) renews the leases before starting the jobs, instead of starting them with a
    lease the worker no longer trusts (which would fence it at once)."""
    store = _SlowClaims(delay=FAST.lease_ttl + 0.2)
    app = App("memory://")
    ran: list[int] = []

    @app.task(name="t.slow_claim")
    async def handler(ctx: JobContext) -> None:
        await asyncio.sleep(0)
        ran.append(ctx.token)

    jid = await app.enqueue_async("t.slow_claim", store=store)
    worker = Worker(app, FAST, store=store)
    async with running(worker) as states:
        await job_in(store, jid, JobState.SUCCEEDED)
        store.delay = 0.0
    assert ran == [1]
    assert WorkerState.FENCED not in states
    assert worker.counters.fenced == 0


class _FenceDuringRefresh(_SlowClaims):
    """A slow claim (its leases are renewed before the jobs start) during whose renewal
    the worker fences, and stays fenced until ``registered`` is set."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.worker: Worker | None = None
        self.registered = asyncio.Event()
        self.registered.set()
        self.fencing: asyncio.Task[None] | None = None

    async def job_leases_renew(self, **kwargs: Any) -> Any:
        renewed = await super().job_leases_renew(**kwargs)
        if kwargs["leases"] and self.fencing is None and self.worker is not None:
            # The renewal of the slow claim (nothing else is in flight): fence now.
            self.registered.clear()
            self.fencing = asyncio.create_task(self.worker._lease_lost("fenced meanwhile"))
            await asyncio.sleep(0)
        return renewed

    async def worker_register(self, **kwargs: Any) -> Any:
        await self.registered.wait()
        return await super().worker_register(**kwargs)


async def test_a_fence_while_a_slow_claim_is_renewed_starts_none_of_its_jobs() -> None:
    """The worker fences while the leases of a slow claim are being renewed: the jobs of
    that claim go back unrun, instead of starting in FENCED (which the state machine
    refuses: the fetch loop crashed and the worker stopped), and run once it is READY."""
    store = _FenceDuringRefresh(delay=FAST.renew_period * 2)
    app = App("memory://")
    ran: list[int] = []

    @app.task(name="t.fenced_claim")
    async def handler(ctx: JobContext) -> None:
        ran.append(ctx.token)

    jid = await app.enqueue_async("t.fenced_claim", store=store)
    worker = Worker(app, FAST, store=store)
    store.worker = worker
    async with running(worker) as states:
        await eventually(lambda: store.fencing is not None, "the worker fenced")
        await eventually_async(
            lambda: _outcome_is(store, jid, "release"), "the claimed job went back unrun"
        )
        assert ran == []
        assert worker.state is WorkerState.FENCED
        store.registered.set()
        store.delay = 0.0
        await job_in(store, jid, JobState.SUCCEEDED)
        assert worker.state is not WorkerState.STOPPED
    assert len(ran) == 1
    assert states.count(WorkerState.STOPPED) == 1  # at the end, by the test


async def _outcome_is(store: Store, job_id: int, outcome: str) -> bool:
    return outcome in await outcomes(store, job_id)


class _SkewedClock:
    """The real clocks, the wall clock shifted by ``offset`` seconds."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def now(self) -> float:
        return time.time() + self.offset

    def monotonic(self) -> float:
        return time.monotonic()


@pytest.mark.parametrize("offset", [3600.0, -3600.0])
async def test_worker_measures_and_reports_its_clock_skew(
    offset: float, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose wall clock is an hour off the store's runs its jobs normally (the
    delay of a retry and its lease are the store's), reports the skew with its heartbeat
    and warns about it in its log."""
    store = MemoryStore()
    app = App("memory://", clock=_SkewedClock(offset))
    attempts: list[int] = []

    @app.task(name="t.skewed", retry=NO_BACKOFF)
    async def handler(ctx: JobContext) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise Retry(0.05)

    jid = await app.enqueue_async("t.skewed", store=store)
    worker = Worker(app, FAST, store=store)
    with caplog.at_level("WARNING", logger="tokenline.worker"):
        async with running(worker):
            await job_in(store, jid, JobState.SUCCEEDED)

            async def reported() -> bool:
                (rec,) = await store.workers_list()
                return rec.clock_skew is not None

            await eventually_async(reported, "the skew to be reported")
            (rec,) = await store.workers_list()
    assert attempts == [1, 2]
    assert rec.clock_skew == pytest.approx(offset, abs=5)
    assert "off the store's" in caplog.text


# -- misuse and logs ------------------------------------------------------------------------


async def test_an_api_used_wrongly_is_dead_at_once_and_says_how_to_fix_it(
    app: App, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """`with ctx.transaction()` in an async handler cannot work: the job goes dead on its
    first attempt (no retries burning the budget), with a reason naming the right form,
    and the worker logs it with the job, attempt, class and reason."""
    calls: list[int] = []

    @app.task(name="t.misuse", max_attempts=5)
    async def misuse(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        with ctx.transaction():
            pass

    jid = await app.enqueue_async("t.misuse", store=store)
    with caplog.at_level("INFO", logger="tokenline.worker"):
        async with running(Worker(app, FAST)):
            job = await job_in(store, jid, JobState.DEAD)
    assert calls == [1]
    assert job.error_class == "permanent"
    assert job.last_error is not None
    assert "async with ctx.transaction()" in job.last_error
    assert f"job {jid} (t.misuse) attempt 1/5: dead (permanent)" in caplog.text


async def test_every_retry_is_logged_with_its_class_and_reason(
    app: App, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A transient failure that will be retried shows in the worker's log at once, with
    the job, the attempt, the class and the reason — not only when the job dies."""

    @app.task(name="t.flaky_log", max_attempts=2, retry=NO_BACKOFF)
    async def flaky(ctx: JobContext) -> None:
        raise ConnectionResetError("peer reset")

    jid = await app.enqueue_async("t.flaky_log", store=store)
    with caplog.at_level("INFO", logger="tokenline.worker"):
        async with running(Worker(app, FAST)):
            await job_in(store, jid, JobState.DEAD)
    assert f"job {jid} (t.flaky_log) attempt 1/2 failed (transient): ConnectionResetError" in (
        caplog.text
    )
    assert f"job {jid} (t.flaky_log) attempt 2/2: dead (transient)" in caplog.text


@pytest.mark.parametrize(("url", "marker"), [("memory://", "?"), ("sqlite", "?")])
async def test_placeholder_is_the_parameter_marker_of_the_stores_connection(
    url: str, marker: str, tmp_path: Any
) -> None:
    """ctx.placeholder is what the connection of ctx.transaction() takes."""
    store_url = f"sqlite:///{tmp_path / 'p.db'}" if url == "sqlite" else url
    from tokenline.stores import store_from_url

    assert store_from_url(store_url).capabilities.placeholder == marker


# -- claims made with a batch of finishes ---------------------------------------------------


class _CountingSlowClaims(MemoryStore):
    """Counts claims, and makes each claim take a moment, so that the fetch loop's claim
    and one made with a batch of finishes are in flight together."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.claims = 0
        #: Claims that came back with jobs (an idle worker's come back empty).
        self.fruitful_claims = 0
        self.finish_and_claims = 0

    async def jobs_claim(self, **kwargs: Any) -> list[ClaimedJob]:
        self.claims += 1
        await asyncio.sleep(self.delay)
        claimed = await super().jobs_claim(**kwargs)
        self.fruitful_claims += bool(claimed)
        return claimed

    async def jobs_finish_and_claim(self, *, finishes: Any, limit: int, **kwargs: Any) -> Any:
        self.finish_and_claims += 1
        await asyncio.sleep(self.delay)
        # The two steps of the memory store itself: not counted as the fetch loop's.
        done = await MemoryStore.jobs_finish(self, finishes=finishes)
        claimed = await MemoryStore.jobs_claim(self, limit=limit, **kwargs) if limit else []
        return done, claimed


def _counting(app: App, name: str) -> dict[str, int]:
    """Register ``name`` as a short async task that counts how many of it run at once:
    the dict's ``most`` is the most seen together."""
    seen = {"now": 0, "most": 0}

    @app.task(name=name)
    async def handler(ctx: JobContext) -> None:
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        await asyncio.sleep(0.001)
        seen["now"] -= 1

    return seen


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_the_next_jobs_come_with_the_finish_and_never_exceed_the_concurrency(
    concurrency: int,
) -> None:
    """Without prefetch, a worker asks for its next jobs in the request that finishes the
    previous ones (one round trip per job at concurrency 1), and the claims in flight
    together never take more jobs than its concurrency."""
    store = _CountingSlowClaims(delay=0.002)
    app = App("memory://")
    seen = _counting(app, "t.count")
    n = 60
    ids = [await app.enqueue_async("t.count", store=store) for _ in range(n)]
    settings = WorkerSettings(
        lease_ttl=30.0,
        renew_interval=10.0,
        poll_interval=0.02,
        rescue_interval=10.0,
        concurrency=concurrency,
        concurrency_control="fixed",
        prefetch=0,
    )
    worker = Worker(app, settings, store=store)
    async with running(worker):
        for jid in ids:
            await job_in(store, jid, JobState.SUCCEEDED)
    assert seen["most"] <= concurrency
    assert worker.counters.succeeded == n
    # Most jobs arrived with a finish; the fetch loop claimed only to start and refill.
    assert store.finish_and_claims >= n // (2 * concurrency)
    if concurrency == 1:
        assert store.claims <= n // 4


async def test_jobs_answered_with_a_batch_free_their_slots_before_the_next_batch_claims() -> None:
    """At several jobs at a time, finishes keep arriving while a batch is in flight.
    The next batch claims for every slot it frees: the jobs of the batch before were
    answered and are not counted as running, so no batch claims short and leaves the
    fetch loop to fill the gap with claims of its own, a statement per job or two."""
    store = _CountingSlowClaims(delay=0.002)
    app = App("memory://")
    running_now: list[int] = []
    most = 0

    @app.task(name="t.refill")
    async def handler(ctx: JobContext) -> None:
        nonlocal most
        running_now.append(ctx.job_id)
        most = max(most, len(running_now))
        # Uneven lengths: finishes arrive one by one, some while a batch is in flight.
        await asyncio.sleep(0.0005 * (ctx.job_id % 7))
        running_now.remove(ctx.job_id)

    n, concurrency = 400, 8
    ids = [await app.enqueue_async("t.refill", store=store) for _ in range(n)]
    settings = dataclasses.replace(QUIET, concurrency=concurrency, concurrency_control="fixed")
    worker = Worker(app, settings, store=store)
    async with running(worker):
        for jid in ids:
            await job_in(store, jid, JobState.SUCCEEDED)
    assert most <= concurrency
    # The fetch loop claims jobs to start and, rarely, when a batch's claim came short.
    claims = store.fruitful_claims
    assert claims <= n // 40, f"{claims} claims beside {store.finish_and_claims} batches"


def test_claims_in_flight_reserve_their_slots() -> None:
    """The fetch loop's claim and one made with a batch of finishes can be in flight
    together: each reserves the slots it asks for, so together they never ask for more
    than the concurrency; a batch counts the slots it is about to free."""
    app = App("memory://")
    settings = WorkerSettings(concurrency=3, concurrency_control="fixed")
    worker = Worker(app, settings, store=MemoryStore())
    first = worker.reserve(0)
    assert first == 3
    assert worker.reserve(0) == 0
    worker.release(first)
    assert worker.reserve(0) == 3
    worker.release(3)
    # Two running jobs: one slot is free; a batch finishing both frees the other two.
    worker._slots = {(1, 1): object(), (2, 1): object()}  # type: ignore[dict-item]
    fetch = worker.reserve(0)
    assert fetch == 1
    assert worker.reserve(2) == 2
    assert worker.reserve(2) == 0


# -- prefetch -------------------------------------------------------------------------------


class _FinishWatch(MemoryStore):
    """Notes, as each batch of finishes is sent, how many jobs the worker had started."""

    def __init__(self) -> None:
        super().__init__()
        self.worker: Worker | None = None
        #: (job ids finished, jobs started by then), one per batch.
        self.sent: list[tuple[list[int], int]] = []

    def _note(self, finishes: Any) -> None:
        if self.worker is not None:
            ids = [f.lease.job_id for f in finishes]
            self.sent.append((ids, self.worker.counters.started))

    async def jobs_finish(self, *, finishes: Any) -> list[bool]:
        self._note(finishes)
        return await super().jobs_finish(finishes=finishes)

    async def jobs_finish_and_claim(self, *, finishes: Any, limit: int, **kwargs: Any) -> Any:
        self._note(finishes)
        done = await MemoryStore.jobs_finish(self, finishes=finishes)
        claimed = await MemoryStore.jobs_claim(self, limit=limit, **kwargs) if limit else []
        return done, claimed


PREFETCH = WorkerSettings(
    lease_ttl=30.0,
    renew_interval=10.0,
    poll_interval=0.02,
    rescue_interval=10.0,
    concurrency=1,
    prefetch=1,
    concurrency_control="fixed",
)


NO_PREFETCH = dataclasses.replace(QUIET, prefetch=0)


@pytest.mark.parametrize("prefetch", [0, 1])
async def test_a_prefetched_job_starts_while_the_last_outcome_is_written(prefetch: int) -> None:
    """With ``prefetch``, the next job is already claimed when a handler returns: it
    starts before the finished job's outcome is sent, so the two overlap, and handlers
    never run more than the concurrency at once. Without it, a job starts only after
    the finish that claims it."""
    store = _FinishWatch()
    app = App("memory://")
    seen = _counting(app, "t.pre")
    n = 20
    ids = [await app.enqueue_async("t.pre", store=store) for _ in range(n)]
    worker = Worker(app, PREFETCH if prefetch else NO_PREFETCH, store=store)
    store.worker = worker
    async with running(worker):
        for jid in ids:
            await job_in(store, jid, JobState.SUCCEEDED)
    assert seen["most"] == 1
    assert worker.counters.succeeded == n
    done = 0
    ahead = 0
    for finished, started in store.sent:
        done += len(finished)
        ahead += started > done
    if prefetch:
        # Every finish but the first and the last goes out with the next job running.
        assert ahead >= n - 3, store.sent
    else:
        assert ahead == 0, store.sent


async def _prefetch_one_behind(
    app: App, store: Store, settings: WorkerSettings
) -> tuple[Worker, int, int, asyncio.Event, list[int], asyncio.Task[None]]:
    """A worker at concurrency 1 with job ``long`` running and job ``next_`` prefetched
    behind it (the finish of a first quick job claimed both)."""
    release = asyncio.Event()
    ran: list[int] = []

    @app.task(name="t.quick")
    async def quick(ctx: JobContext) -> None:
        ran.append(ctx.job_id)

    @app.task(name="t.long")
    async def long(ctx: JobContext) -> None:
        ran.append(ctx.job_id)
        await release.wait()

    await app.enqueue_async("t.quick", store=store)
    long_id = await app.enqueue_async("t.long", store=store)
    next_id = await app.enqueue_async("t.quick", store=store)
    worker = Worker(app, settings, store=store)
    task = asyncio.create_task(worker.run())
    await eventually(lambda: worker._waiting and ran[-1:] == [long_id], "a job waits prefetched")
    return worker, long_id, next_id, release, ran, task


async def test_drain_gives_prefetched_jobs_back_unrun() -> None:
    """A shutdown gives a prefetched job back at once, with no attempt spent, while the
    running job finishes: another worker may take it."""
    app = App("memory://")
    store = app.open_store()
    worker, long_id, next_id, release, ran, task = await _prefetch_one_behind(app, store, PREFETCH)
    worker.request_shutdown()
    back = await job_in(store, next_id, JobState.QUEUED)
    assert back.attempt == 0
    assert next_id not in ran
    release.set()
    await asyncio.wait_for(task, DEADLINE)
    assert (await store.job_get(job_id=long_id)).state is JobState.SUCCEEDED
    assert next_id not in ran
    assert (await store.job_get(job_id=next_id)).state is JobState.QUEUED
    # The summary adds up: the job given back unrun is not one of those started.
    c = worker.counters
    assert (c.started, c.succeeded, c.released, c.unrun) == (2, 2, 0, 1), c
    assert "started 2 jobs: 2 succeeded, 0 retried, 0 dead, 0 given back" in c.summary()
    assert "1 prefetched job given back unrun" in c.summary()
    # A leader rescues its own expired jobs too: not said to be "of other workers".
    assert "rescued 0 jobs whose lease had expired" in c.summary()


async def test_a_prefetched_job_waits_at_most_a_renewal_interval() -> None:
    """A prefetched job held behind a long one goes back after ``renew_interval``, unrun,
    and runs later: a long job never keeps the next one from free workers."""
    app = App("memory://")
    store = app.open_store()
    settings = dataclasses.replace(PREFETCH, lease_ttl=3.0, renew_interval=0.2)
    await _given_back_then_run(store, *await _prefetch_one_behind(app, store, settings))


async def _given_back_then_run(
    store: Store,
    worker: Worker,
    long_id: int,
    next_id: int,
    release: asyncio.Event,
    ran: list[int],
    task: asyncio.Task[None],
) -> None:
    """The job prefetched behind the long one comes back unrun (no attempt spent) while
    the long one runs, and runs once the long one is done."""
    try:
        back = await job_in(store, next_id, JobState.QUEUED)
        assert back.attempt == 0
        assert next_id not in ran
        assert long_id in ran
        assert not worker._waiting
        release.set()
        await job_in(store, next_id, JobState.SUCCEEDED)
        assert ran.count(next_id) == 1
    finally:
        release.set()
        worker.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)


async def test_a_fenced_worker_gives_back_its_prefetched_jobs() -> None:
    """Fencing gives back the prefetched jobs with the running ones: none is left leased
    to a worker that has stopped trusting its leases."""
    app = App("memory://")
    store = app.open_store()
    worker, _long_id, next_id, release, _ran, task = await _prefetch_one_behind(
        app, store, PREFETCH
    )
    try:
        await worker._lease_lost("test: lease lost")
        back = await job_in(store, next_id, JobState.QUEUED)
        assert back.attempt == 0
        assert not worker._waiting
        assert not worker._slots or all(s.waiting_since is None for s in worker._slots.values())
    finally:
        release.set()
        worker.request_shutdown()
        worker.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)


def _ahead_of_finishes(store: _FinishWatch) -> int:
    """How many batches of finishes were sent with a later job already started."""
    done = ahead = 0
    for finished, started in store.sent:
        done += len(finished)
        ahead += started > done
    return ahead


AUTO = dataclasses.replace(PREFETCH, prefetch="auto")


async def _run_all(app: App, store: _FinishWatch, task: str, n: int) -> Worker:
    """Enqueue ``n`` jobs of ``task``, run an ``AUTO`` worker until all succeeded."""
    ids = [await app.enqueue_async(task, store=store) for _ in range(n)]
    worker = Worker(app, AUTO, store=store)
    store.worker = worker
    async with running(worker):
        for jid in ids:
            await job_in(store, jid, JobState.SUCCEEDED)
    assert worker.counters.succeeded == n
    return worker


async def test_auto_prefetch_claims_ahead_of_short_handlers(clock: FakeClock) -> None:
    """``prefetch = "auto"`` behind handlers that take no time (on the worker's frozen
    clock): the next job is claimed with each finish and starts while it is written, as
    with a fixed prefetch; handlers still run one at a time."""
    store = _FinishWatch()
    app = App("memory://", clock=clock)
    seen = _counting(app, "t.auto_short")
    await _run_all(app, store, "t.auto_short", 20)
    assert seen["most"] == 1
    assert _ahead_of_finishes(store) >= len(store.sent) - 2, store.sent


async def test_auto_prefetch_claims_nothing_ahead_of_long_handlers(clock: FakeClock) -> None:
    """``prefetch = "auto"`` behind handlers that each take 100 ms of the worker's clock
    (longer than the 20 ms a prefetched job may expect to wait): no job is ever claimed
    ahead of a free slot, so none waits leased where another worker could run it."""
    store = _FinishWatch()
    app = App("memory://", clock=clock)

    @app.task(name="t.auto_long")
    async def slow(ctx: JobContext) -> None:
        clock.advance(0.1)

    worker = await _run_all(app, store, "t.auto_long", 12)
    assert _ahead_of_finishes(store) == 0, store.sent
    assert (worker.counters.released, worker.counters.unrun) == (0, 0)


async def test_an_auto_prefetched_job_waits_at_most_a_second(clock: FakeClock) -> None:
    """Under ``prefetch = "auto"`` a job prefetched behind one that runs far longer
    than the ones before it is given back unrun once it has waited 1 s (here, with a
    renewal interval of 10 s, the patience of a fixed prefetch), and runs later."""
    app = App("memory://", clock=clock)
    store = app.open_store()
    behind = await _prefetch_one_behind(app, store, AUTO)
    clock.advance(1.5)
    await _given_back_then_run(store, *behind)


async def test_with_jobs_prefetched_finishes_go_out_together_with_the_refill() -> None:
    """With jobs prefetched to run meanwhile, finishes are gathered (half the prefetch)
    and go out together with the claim that refills the worker: a few statements for
    many jobs, not one per job, while handlers still run one at a time."""
    store = _FinishWatch()
    app = App("memory://")
    seen = _counting(app, "t.gather")
    n = 60
    ids = [await app.enqueue_async("t.gather", store=store) for _ in range(n)]
    worker = Worker(app, dataclasses.replace(PREFETCH, prefetch=8), store=store)
    store.worker = worker
    async with running(worker):
        for jid in ids:
            await job_in(store, jid, JobState.SUCCEEDED)
    assert seen["most"] == 1
    assert worker.counters.succeeded == n
    sizes = [len(finished) for finished, _ in store.sent]
    assert sum(sizes) == n
    # Sent one by one, there would be n batches; gathered by 4, about n / 4.
    assert len(sizes) <= n // 2, sizes
    assert max(sizes) >= 4, sizes


async def test_a_fence_while_an_outcome_is_gathered_records_it_and_never_reruns_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job whose outcome waits in the completer when the worker fences is not given
    back as unrun: its outcome is written, it stays succeeded with one run, and no stale
    write is recorded; the prefetched jobs go back unrun and run later."""
    # Gathered outcomes wait for the fence, however slow the machine.
    monkeypatch.setattr(completer, "GATHER_WAIT", 60.0)
    store = _FinishWatch()
    app = App("memory://")
    worker = Worker(app, dataclasses.replace(PREFETCH, prefetch=8), store=store)
    ran: list[int] = []
    third = asyncio.Event()
    go_on = asyncio.Event()

    @app.task(name="t.fence")
    async def handler(ctx: JobContext) -> None:
        ran.append(ctx.job_id)
        if len(ran) == 3:
            # The second job's outcome is gathered: jobs wait prefetched to run meanwhile.
            third.set()
            await go_on.wait()

    ids = [await app.enqueue_async("t.fence", store=store) for _ in range(10)]
    async with running(worker):
        await asyncio.wait_for(third.wait(), DEADLINE)
        assert worker._completer is not None
        assert [f.lease.job_id for f, _ in worker._completer._pending] == [ids[1]]
        await worker._lease_lost("test: lease lost")
        go_on.set()
        for jid in ids:
            await job_in(store, jid, JobState.SUCCEEDED)
    second = await store.job_get(job_id=ids[1])
    assert second.attempt == 1
    assert ran.count(ids[1]) == 1, ran
    assert (await store.stale_commits())[0] == 0


@pytest.mark.parametrize(
    ("worker_id", "said"),
    [
        ('w"\\\n<script>', "must not contain control characters"),
        ("w\x1b[2J", "must not contain control characters"),
        ("", "must be a non-empty string"),
        ("w" * 256, "must be a non-empty string of at most 255 characters"),
    ],
)
def test_a_worker_id_is_checked_as_keys_are(app: App, worker_id: str, said: str) -> None:
    """A worker id with a line break was taken: `tokenline workers` printed it across
    two lines and `tokenline drain` could not name it. Refused when the worker is made,
    naming worker_id; the default id and a plain given one are kept."""
    from tokenline import InvalidInputError

    with pytest.raises(InvalidInputError, match=f"worker_id {said}"):
        Worker(app, worker_id=worker_id)
    assert Worker(app, worker_id="web-1:blue").id == "web-1:blue"
    assert Worker(app).id


class _AnswerLost(MemoryStore):
    """A store that makes a success's commit, then loses its answer, once."""

    def __init__(self) -> None:
        super().__init__()
        self.lose = 1

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        done = await super().jobs_finish(finishes=finishes)
        if self.lose and any(f.outcome is Outcome.SUCCEEDED for f in finishes):
            self.lose -= 1
            raise StoreUnavailableError("connection reset after the commit")
        return done


async def test_a_commit_made_whose_answer_was_lost_is_not_made_again() -> None:
    """The store made a job's success, then its answer was lost. The worker took the
    commit for failed: it tried it again, was refused (the job no longer running), and
    fenced itself, and the store recorded a stale write that was the worker's own
    success. It now asks first whether the attempt already ended that way: the job
    counts as succeeded once, nothing is refused, the worker keeps working."""
    store = _AnswerLost()
    app = App("memory://")
    ran: list[int] = []

    @app.task(name="t.lost_answer")
    async def handler(ctx: JobContext) -> None:
        ran.append(ctx.attempt)

    # Renewals often: after the failed commit the worker claims again once one passes.
    worker = Worker(app, dataclasses.replace(QUIET, renew_interval=0.3), store=store)
    async with running(worker) as states:
        jid = await app.enqueue_async("t.lost_answer", store=store)
        await eventually(lambda: worker.counters.succeeded == 1, "the success counted")
        second = await app.enqueue_async("t.lost_answer", store=store)
        await eventually(lambda: worker.counters.succeeded == 2, "the next job run")
    assert store.lose == 0  # the answer was lost
    assert ran == [1, 1]
    assert (await store.job_get(job_id=jid)).state is JobState.SUCCEEDED
    assert (await store.job_get(job_id=second)).state is JobState.SUCCEEDED
    assert (worker.counters.stale_refused, worker.counters.fenced) == (0, 0)
    assert WorkerState.FENCED not in states
    assert await store.stale_commits() == (0, [])


class _AnswerLostThenJobGone(_AnswerLost):
    """:class:`_AnswerLost`, whose job is then lost too, with the answer (a broker
    whose keys were lost: a Redis restarted without its data)."""

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        losing = self.lose and any(f.outcome is Outcome.SUCCEEDED for f in finishes)
        try:
            return await super().jobs_finish(finishes=finishes)
        finally:
            if losing:
                for f in finishes:
                    del self._jobs[f.lease.job_id]


async def test_a_job_gone_from_the_store_while_its_commit_is_retried_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The retried commit's first question, whether the lost answer's commit was made,
    raised JobNotFoundError for a job the broker had lost meanwhile: the job's task died
    with it, unlogged until asyncio reported it as never retrieved, and the worker's
    summary left the job out. It is now said at once and counted as unanswered; the
    worker goes on."""
    store = _AnswerLostThenJobGone()
    app = App("memory://")
    failures: list[BaseException] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, context: failures.append(context["exception"])
    )

    @app.task(name="t.gone")
    async def handler(ctx: JobContext) -> None:
        pass

    worker = Worker(app, dataclasses.replace(QUIET, renew_interval=0.3), store=store)
    with caplog.at_level(logging.WARNING, logger="tokenline.worker"):
        async with running(worker) as states:
            jid = await app.enqueue_async("t.gone", store=store)
            await eventually(lambda: worker.counters.unanswered == 1, "the loss counted")
            second = await app.enqueue_async("t.gone", store=store)
            await job_in(store, second, JobState.SUCCEEDED)
    gc_collect()
    assert failures == []
    said = [r.getMessage() for r in caplog.records if "is gone from the store" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"job {jid} " in said[0]
    assert WorkerState.FENCED not in states
    assert worker.counters.succeeded == 1


async def _rescued_while_running(
    store: MemoryStore, clock: FakeClock, counted: Callable[[Worker], bool]
) -> tuple[Worker, int]:
    """Run a job on a worker, rescue it from under the worker (the store's clock past
    its lease, the worker's not), and wait until the worker fenced and ``counted``
    holds; the worker and the job's id."""
    app = App("memory://")
    started, release = asyncio.Event(), asyncio.Event()

    @app.task(name="t.rescued")
    async def handler(ctx: JobContext) -> None:
        started.set()
        await release.wait()

    worker = Worker(app, dataclasses.replace(QUIET, renew_interval=0.3), store=store)
    async with running(worker) as states:
        jid = await app.enqueue_async("t.rescued", store=store)
        await asyncio.wait_for(started.wait(), DEADLINE)
        clock.advance(QUIET.lease_ttl + 1)
        assert (await store.jobs_rescue()).requeued == [jid]  # the token moves on
        await eventually(lambda: WorkerState.FENCED in states, "the worker fenced")
        await eventually(lambda: counted(worker), "the refusal counted")
        release.set()
    return worker, jid


async def test_a_give_back_the_store_refuses_is_counted_as_the_store_records_it() -> None:
    """A worker fenced while a job of its was rescued gives the job back; the store
    refuses that (the token moved on) and records a stale write, but the worker's
    summary said "0 stale writes refused". It now counts the refusal too."""
    clock = FakeClock()
    store = MemoryStore(clock=clock)  # the store's time only: the worker's runs on
    _, jid = await _rescued_while_running(store, clock, lambda w: w.counters.stale_refused == 1)
    count, stale = await store.stale_commits()
    assert count >= 1
    assert {(s.job_id, s.operation) for s in stale} >= {(jid, "release")}


class _ReleaseAnswerLost(MemoryStore):
    """A store that makes every give-back (refusing it, if its token moved on, and
    recording that as a stale write), then loses its answer."""

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        done = await super().jobs_finish(finishes=finishes)
        if any(f.outcome is Outcome.RELEASE for f in finishes):
            raise StoreUnavailableError("connection reset after the give-back")
        return done


async def test_a_give_back_whose_answer_was_lost_is_counted_as_unanswered() -> None:
    """A worker's renewal found its job rescued, and its give-back reached the store,
    which refused it as stale, and its answer was lost: the summary said "0 stale writes
    refused" while the audit listed two. It now counts the refused renewal, and the
    give-back as unanswered, pointing to the audit."""
    clock = FakeClock()
    store = _ReleaseAnswerLost(clock=clock)
    worker, jid = await _rescued_while_running(store, clock, lambda w: w.counters.unanswered == 1)
    count, stale = await store.stale_commits()
    assert {(s.job_id, s.operation) for s in stale} >= {(jid, "release")}
    counters = worker.counters
    # Every refusal the store recorded is in the summary, answered or not: the renewal
    # that found the job rescued, and the give-back whose answer was lost.
    assert counters.renewals_refused == 1
    assert count <= counters.stale_refused + counters.renewals_refused + counters.unanswered
    assert "given back unanswered (the store may have refused some" in counters.summary()


async def test_a_lease_lost_while_fencing_counts_no_second_fencing(clock: FakeClock) -> None:
    """Two paths found the same expired lease by the worker's clock while the worker was
    already fencing: the summary said "fenced 1 time (2 by its own clock)". A fencing
    by the worker's own clock is now counted with the fencing itself, once."""
    app = App("memory://", clock=clock)
    worker = Worker(app, WATCHED)
    async with running(worker):
        await eventually(lambda: worker._membership_token > 0, "the worker registers")
        await worker._lease_lost("first", own_clock=True)
        await eventually(lambda: worker.state is WorkerState.READY, "the worker re-registers")
        worker._fencing = True  # as while the first fencing is under way
        await worker._lease_lost("second, found while fencing", own_clock=True)
        worker._fencing = False
    assert (worker.counters.fenced, worker.counters.self_fenced) == (1, 1)
    assert "fenced 1 time (1 by its own clock)" in worker.counters.summary()


@pytest.mark.parametrize("keep", ["on", "sabotaged"])
async def test_an_effect_past_its_handlers_hard_timeout_never_runs_beside_itself(
    monkeypatch: pytest.MonkeyPatch, keep: str
) -> None:
    """A sync handler's hard timeout came while its thread ran ``ctx.effect``'s callee.
    The attempt ended at once, so its lease was gone while the key was still pending
    under it: the job's next attempt, and another job of the same key, took the key
    over and ran the callee again, beside the first run. The attempt is now kept, its
    lease renewed, until the effect is over: the callee runs once."""
    if keep == "sabotaged":  # the control: the attempt ends at once, as it used to

        async def at_once(self: Worker, slot: object) -> None:
            return None

        monkeypatch.setattr(Worker, "_effect_over", at_once)
    app = App("memory://")
    store = app.open_store()
    runs: list[tuple[int, float, float]] = []
    charging = threading.Event()

    def charge(token: int) -> str:
        charging.set()
        began = time.monotonic()
        time.sleep(1.5)  # past the handler's hard timeout
        runs.append((token, began, time.monotonic()))
        return "charged"

    @app.task(name="t.pay", timeout=0.5, max_attempts=3, retry=NO_BACKOFF)
    def pay(ctx: JobContext) -> None:
        ctx.effect("charge:42", charge, ctx.token)

    worker = Worker(app, dataclasses.replace(QUIET, concurrency=3), store=store)
    async with running(worker):
        first = await app.enqueue_async("t.pay", store=store)
        await asyncio.to_thread(charging.wait, DEADLINE)
        other = await app.enqueue_async("t.pay", store=store)  # the same key, another job
        for jid in (first, other):  # dead too, with the control: every attempt timed out
            await job_in(store, jid, JobState.SUCCEEDED, JobState.DEAD)
        # Every thread that ran the callee has returned.
        await eventually(lambda: worker.sync_handlers_running == 0, "the threads return")
    (record,) = await store.effects_list(key="charge:42")
    if keep == "sabotaged":
        assert len(runs) >= 2  # run again while the first run went on
        return
    assert len(runs) == 1, runs
    assert record.runs == 1
    # The timed-out attempt ended after its effect, which the next attempt found done;
    # the other job waited for the key (timing out too, while it waited), then found
    # it done as well.
    assert await outcomes(store, first) == ["retry", "succeeded"]
    assert (await outcomes(store, other))[-1] == "succeeded"


async def test_jobs_contending_for_one_resource_lease_wait_their_turn() -> None:
    """Five jobs each take the lease on one account, tried once (no ``wait``), as the
    README's debit does. A job that found it held spent an attempt, and with a few
    jobs at once some ended dead. They now wait their turn: all succeed, none spends
    an attempt on the contention."""
    app = App("memory://")
    store = app.open_store()
    done: list[int] = []

    @app.task(name="t.debit", max_attempts=1, retry=NO_BACKOFF)
    async def debit(ctx: JobContext, n: int) -> None:
        async with ctx.lease("account:42"):
            await asyncio.sleep(0.05)  # others come meanwhile and find it held
            done.append(n)

    worker = Worker(app, dataclasses.replace(QUIET, concurrency=5), store=store)
    async with running(worker):
        ids = [await app.enqueue_async("t.debit", n, store=store) for n in range(5)]
        for jid in ids:
            await job_in(store, jid, JobState.SUCCEEDED, JobState.DEAD)
    assert sorted(done) == list(range(5))
    for jid in ids:
        job = await store.job_get(job_id=jid)
        assert (job.state, job.attempt) == (JobState.SUCCEEDED, 1)


class _ClaimsDown(MemoryStore):
    """A store whose claims fail while its renewals answer: the split topology with its
    ledger silent (the claim asks the ledger; renewals go to Redis)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.claims = 0

    async def jobs_claim(self, **kwargs: Any) -> list[ClaimedJob]:
        self.claims += 1
        if self.down:
            err = StoreUnavailableError("no connection to PostgreSQL within 2s")
            err.server = "PostgreSQL"
            raise err
        return await super().jobs_claim(**kwargs)


async def test_a_worker_whose_claims_fail_drains_until_a_claim_answers() -> None:
    """Claims failed (a silent ledger) while renewals answered: each renewal made the
    worker READY again, the next claim DRAINING, every renewal interval, and /readyz
    flipped with it while the worker ran nothing. It now drains until a claim answers,
    claiming on as its probe, and runs the jobs once one does."""
    store = _ClaimsDown()
    app = App("memory://")

    @app.task(name="t.after")
    async def after(ctx: JobContext) -> None:
        return None

    seen: list[events.Event] = []
    events.add_hook(seen.append)
    worker = Worker(app, dataclasses.replace(FAST, lease_ttl=3.0, renew_interval=0.1), store=store)
    try:
        async with running(worker) as states:
            jid = await app.enqueue_async("t.after", store=store)
            await eventually(lambda: WorkerState.DRAINING in states, "the worker drains")
            renewed = worker.counters.coordination_errors
            await eventually(lambda: store.claims >= renewed + 5, "claims go on as probes")
            # Several renewals answered meanwhile; the worker stayed DRAINING.
            assert states[states.index(WorkerState.DRAINING) :] == [WorkerState.DRAINING]
            store.down = False
            await job_in(store, jid, JobState.SUCCEEDED)
            assert WorkerState.READY in states[states.index(WorkerState.DRAINING) :]
    finally:
        events.remove_hook(seen.append)
    channels = {e.channel for e in seen if isinstance(e, events.CoordinationFailed)}
    assert channels == {"broker"}  # one store for all roles: the claim's own channel


async def test_a_retry_the_budget_delays_says_so_on_the_job(app: App, store: Store) -> None:
    """A retry past the queue's budget waited a whole window while the job's record
    showed only the handler's reason: the wait looked like a backoff gone wrong. The
    job's last error now says the budget held it."""

    @app.task(name="t.flaky", max_attempts=3, retry=NO_BACKOFF)
    async def flaky(ctx: JobContext) -> None:
        raise RuntimeError("upstream 503")

    ids = [await app.enqueue_async("t.flaky", store=store) for _ in range(8)]
    # 8 first attempts allow 1.6 retries (ratio 0.2) and the floor 0.1 more in 1 s.
    settings = dataclasses.replace(FAST, retry_budget_window=1.0, concurrency=8)
    async with running(Worker(app, settings)):
        await eventually_async(
            lambda: _all_in(store, ids, JobState.DEAD), "every job ran its attempts"
        )
    errors = [a.error or "" for jid in ids for a in await store.job_attempts(job_id=jid)]
    held = [e for e in errors if "the retry budget of queue 'default' was spent" in e]
    assert held, errors
    assert all(e.startswith("RuntimeError: upstream 503 (the retry budget") for e in held)
    assert all(e.endswith("it waits 1s)") for e in held)


async def _all_in(store: Store, ids: list[int], state: JobState) -> bool:
    """Whether every job of ``ids`` is in ``state``."""
    return [(await store.job_get(job_id=jid)).state for jid in ids] == [state] * len(ids)
