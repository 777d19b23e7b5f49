"""The ledger as handlers use it: ctx.effect, ctx.fenced, ctx.lease and unique enqueue,
through a real worker on the in-memory store (sync and async handlers alike)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import math
import threading
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tokenline import (
    App,
    InvalidInputError,
    Job,
    JobContext,
    JobState,
    LeaseExpiredError,
    NotSupportedError,
    RetryPolicy,
    Settings,
    Worker,
    WorkerSettings,
    current_effect,
    require_fenced,
)
from tokenline._clock import FakeClock
from tokenline._errors import StaleTokenError, StoreUnavailableError
from tokenline._jobs import Lease
from tokenline._records import DuplicateKind, EffectStatus
from tokenline.effects import EffectRun
from tokenline.stores import MemoryStore, Store

#: Deadline for anything a test waits on; a healthy run takes a small fraction of it.
DEADLINE = 10.0
#: Small intervals so the worker's loops turn quickly (renewal below a third of the TTL).
FAST = WorkerSettings(
    lease_ttl=0.6, renew_interval=0.15, poll_interval=0.02, rescue_interval=0.1, concurrency=4
)


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[None]:
    """Run ``worker`` in the background; stop it at once afterwards."""
    task = asyncio.create_task(worker.run(), name="test-worker")
    try:
        yield
    finally:
        if not task.done():
            worker.request_shutdown()
            worker.request_shutdown()
        await asyncio.wait_for(task, DEADLINE)


async def job_in(store: Store, job_id: int, state: JobState) -> Job:
    """Wait until the job reaches ``state`` and return it."""

    async def poll() -> Job:
        # Polling: the store has no event for a job's state change.
        while (job := await store.job_get(job_id=job_id)).state is not state:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        return job

    try:
        return await asyncio.wait_for(poll(), DEADLINE)
    except TimeoutError:
        job = await store.job_get(job_id=job_id)
        pytest.fail(f"job {job_id} stayed {job.state.value} ({job.last_error}), not {state}")


@pytest.fixture
def app() -> App:
    """An in-memory app on the real clock."""
    return App("memory://")


@pytest.fixture
def store(app: App) -> Store:
    """The app's (shared) in-memory store."""
    return app.open_store()


# -- unique enqueue ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique": True}, "needs an idempotency_key"),
        ({"idempotency_key": "k", "unique_for": 5}, "unique_for needs unique"),
        ({"idempotency_key": "k", "unique": "yes"}, "unique must be"),
        ({"idempotency_key": "k", "unique": True, "unique_for": 0}, "unique_for must be"),
        ({"idempotency_key": "k", "unique": True, "unique_for": float("nan")}, "unique_for"),
        ({"idempotency_key": "", "unique": True}, "idempotency_key"),
        ({"idempotency_key": "k" * 256, "unique": True}, "256 characters"),
    ],
)
def test_bad_unique_options_are_refused_before_anything_is_stored(
    app: App, options: dict[str, Any], message: str
) -> None:
    """Each invalid combination names what is wrong; no job is stored."""

    @app.task(name="t")
    def t(ctx: JobContext) -> None:
        """No-op."""

    with pytest.raises(InvalidInputError, match=message):
        app.enqueue("t", **options)
    assert app.run(lambda s: s.jobs_list()) == []


def test_unique_enqueue_through_the_app_returns_the_existing_job(app: App) -> None:
    """enqueue and enqueue_many with unique: one job per key, its id returned again."""

    @app.task(name="t")
    def t(ctx: JobContext, n: int) -> None:
        """No-op."""

    first = app.enqueue("t", 1, idempotency_key="invoice:1", unique=True)
    assert app.enqueue("t", 2, idempotency_key="invoice:1", unique=True) == first
    ids = app.enqueue_many("t", [(1,), (2,), (3,)], keys=["invoice:1", "b", "b"], unique="active")
    assert ids[0] == first
    assert ids[1] == ids[2] != first
    assert len(app.run(lambda s: s.jobs_list())) == 2


# -- effects ----------------------------------------------------------------------------
async def test_sync_and_async_handlers_apply_an_effect_once_per_key(app: App, store: Store) -> None:
    """Two jobs (one sync, one async handler) run one key: the callee runs once, sees the
    key through current_effect(), and both jobs get the same result."""
    calls: list[str] = []
    results: list[Any] = []
    lock = threading.Lock()

    def send(to: str) -> dict[str, str]:
        effect = current_effect()
        assert effect is not None
        with lock:
            calls.append(effect.key)
        return {"to": to}

    @app.task(name="t.sync")
    def sync_handler(ctx: JobContext, to: str) -> None:
        results.append(ctx.effect(f"email:{to}", send, to))

    @app.task(name="t.async")
    async def async_handler(ctx: JobContext, to: str) -> None:
        results.append(await ctx.effect_async(f"email:{to}", send, to))

    a = await app.enqueue_async("t.sync", "ann", store=store)
    b = await app.enqueue_async("t.async", "ann", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, a, JobState.SUCCEEDED)
        await job_in(store, b, JobState.SUCCEEDED)
    assert calls == ["email:ann"]
    assert results == [{"to": "ann"}] * 2
    assert current_effect() is None
    (dup,) = await store.duplicates_list()
    assert dup.kind is DuplicateKind.REPEAT


async def test_a_failing_effect_is_retried_and_runs_again(app: App, store: Store) -> None:
    """The callee's error fails the attempt (recorded failed); the retry runs it again."""
    attempts: list[int] = []

    def flaky(attempt: int) -> str:
        attempts.append(attempt)
        if attempt == 1:
            raise ConnectionResetError("api down")
        return "ok"

    @app.task(name="t.flaky", retry=RetryPolicy(base=0.001, cap=0.001))
    async def handler(ctx: JobContext) -> None:
        await ctx.effect_async("call:1", flaky, ctx.attempt)

    jid = await app.enqueue_async("t.flaky", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, jid, JobState.SUCCEEDED)
    assert attempts == [1, 2]
    (record,) = await store.effects_list(key="call:1")
    assert (record.status, record.runs) == (EffectStatus.COMPLETED, 2)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize(
    ("result", "said"),
    [
        (object(), "cannot be stored as JSON"),
        ("x" * 600, "over the limit of 500"),
        # Python's message for it advised sys.set_int_max_str_digits().
        ([10**5000], "an integer of more than 4300 digits"),
    ],
    ids=["not-json", "too-big", "huge-int"],
)
async def test_an_effect_whose_result_cannot_be_stored_dead_letters_the_job_and_never_reruns(
    kind: str, result: object, said: str
) -> None:
    """A result that is not JSON, or larger than max_payload_bytes, is a bug that would
    fail every attempt: the job goes dead at once with the reason. The effect has run,
    so its key is completed (without a result), not failed: the job retried from the
    dead letters does not run it again, and fails saying why there is no result."""
    app = App("memory://", settings=Settings(max_payload_bytes=500))
    store = app.open_store()
    calls: list[int] = []

    def callee() -> object:
        calls.append(1)
        return result

    if kind == "sync":

        @app.task(name="t.bad")
        def handler(ctx: JobContext) -> None:
            ctx.effect("k", callee)

    else:

        @app.task(name="t.bad")
        async def handler_async(ctx: JobContext) -> None:
            await ctx.effect("k", callee)

    jid = await app.enqueue_async("t.bad", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.DEAD)
        assert job.error_class == "permanent"
        assert said in (job.last_error or "")
        (record,) = await store.effects_list()
        assert (record.status, record.result) == (EffectStatus.COMPLETED, None)
        assert await store.jobs_retry_dead(job_ids=[jid]) == 1  # queued again, at once
        job = await job_in(store, jid, JobState.DEAD)
    assert "ran once" in (job.last_error or "")
    assert calls == [1]


async def test_one_name_serves_both_kinds_of_handler(app: App, store: Store) -> None:
    """In an async handler ``await ctx.effect(...)`` and ``await ctx.fenced(...)`` work
    under the same names as in a sync one; the blocking ``with`` forms of ctx.lease and
    ctx.transaction, which would stall the event loop, raise NotSupportedError naming
    ``async with`` instead."""
    seen: list[str] = []
    results: list[object] = []

    @app.task(name="t.both")
    async def handler(ctx: JobContext) -> None:
        results.append(await ctx.effect("k", lambda: 1))
        results.append(await ctx.fenced("f"))
        for attempt in (lambda: ctx.lease("r").__enter__(), lambda: ctx.transaction().__enter__()):
            with pytest.raises(NotSupportedError) as info:
                attempt()
            seen.append(str(info.value))

    jid = await app.enqueue_async("t.both", store=store)
    async with running(Worker(app, FAST)):
        job = await job_in(store, jid, JobState.SUCCEEDED)
    assert results == [1, job.lease_token]
    assert ["async with" in text for text in seen] == [True, True]
    assert [e.key for e in await store.effects_list()] == ["k"]


async def test_an_effect_called_from_inside_itself_is_refused_at_once(
    app: App, store: Store
) -> None:
    """An effect that runs its own key again before returning would wait for itself, on
    every attempt, then blame "another" attempt: it is refused at once, the job dead on
    its first attempt, in both kinds of handler, through a chain of effects as well. A
    key that another effect of the same attempt runs after the first returned is not."""
    calls: list[str] = []

    @app.task(name="t.nested_sync", max_attempts=3)
    def nested_sync(ctx: JobContext) -> None:
        ctx.effect("a", lambda: ctx.effect("b", lambda: ctx.effect("a", lambda: 1, wait=60)))

    @app.task(name="t.nested_async", max_attempts=3)
    async def nested_async(ctx: JobContext) -> None:
        async def inner() -> int:
            return int(await ctx.effect("a", lambda: 1, wait=60))

        await ctx.effect("a", inner)

    @app.task(name="t.in_turn")
    async def in_turn(ctx: JobContext) -> None:
        async def both() -> None:
            calls.append("x")

        await ctx.effect("x", both)
        await ctx.effect("y", lambda: ctx.effect("x", both))

    ids = [await app.enqueue_async(t, store=store) for t in ("t.nested_sync", "t.nested_async")]
    ok = await app.enqueue_async("t.in_turn", store=store)
    async with running(Worker(app, FAST)):
        dead = [await job_in(store, jid, JobState.DEAD) for jid in ids]
        await job_in(store, ok, JobState.SUCCEEDED)
    for job in dead:
        assert job.attempt == 1
        assert job.error_class == "permanent"
        assert "effect 'a' is called from inside itself" in (job.last_error or "")
    assert calls == ["x"]


class _LosingStore(MemoryStore):
    """Fails the first record of each effect's outcome: before the write (``lose`` is
    "request") or after it, as a connection cut before the answer (``"answer"``)."""

    def __init__(self, lose: str) -> None:
        super().__init__()
        self.lose = lose
        self.failed: set[str] = set()

    async def effect_finish(
        self, *, lease: Lease, key: str, result: str | None = None, error: str | None = None
    ) -> bool:
        if key in self.failed:
            return await super().effect_finish(lease=lease, key=key, result=result, error=error)
        self.failed.add(key)
        if self.lose == "answer":
            await super().effect_finish(lease=lease, key=key, result=result, error=error)
        raise StoreUnavailableError(f"connection lost ({self.lose})")


@pytest.mark.parametrize("lose", ["request", "answer"])
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_an_effect_whose_record_fails_once_is_recorded_not_run_again(
    lose: str, kind: str
) -> None:
    """The callee ran, and the record of its outcome did not reach the store (or its
    answer was lost): the record is tried again while the lease is trusted, so the job
    succeeds on its first attempt and the callee never runs twice. Before, the attempt
    failed, the next one took the pending key over and ran the callee again."""
    app = App("memory://")
    store = _LosingStore(lose)
    calls: list[int] = []

    def send(token: int) -> str:
        calls.append(token)
        return "sent"

    if kind == "sync":

        @app.task(name="t.mail", retry=RetryPolicy(base=0.001, cap=0.001))
        def mail(ctx: JobContext) -> None:
            assert ctx.effect("mail:1", send, ctx.token) == "sent"

    else:

        @app.task(name="t.mail", retry=RetryPolicy(base=0.001, cap=0.001))
        async def amail(ctx: JobContext) -> None:
            assert await ctx.effect("mail:1", send, ctx.token) == "sent"

    jid = await app.enqueue_async("t.mail", store=store)
    async with running(Worker(app, FAST, store=store)):
        job = await job_in(store, jid, JobState.SUCCEEDED)
    assert (job.attempt, calls) == (1, [1])
    (record,) = await store.effects_list(key="mail:1")
    assert (record.status, record.runs, record.result) == (EffectStatus.COMPLETED, 1, '"sent"')
    assert await store.duplicates_list() == []


# -- fences and resource leases ---------------------------------------------------------
async def test_fenced_uses_the_resource_lease_token_inside_ctx_lease(
    app: App, store: Store
) -> None:
    """Inside ctx.lease(key) the fence carries the lease's token, outside the job's; the
    returned token is the one to write into your own rows."""
    seen: dict[str, int] = {}

    @app.task(name="t.sync")
    def sync_handler(ctx: JobContext) -> None:
        seen["job"] = ctx.fenced("invoice:1")
        with ctx.lease("account:1") as held:
            seen["lease"] = ctx.fenced("account:1")
            seen["held"] = held.token

    @app.task(name="t.async")
    async def async_handler(ctx: JobContext) -> None:
        async with ctx.lease("account:1") as held:
            seen["lease2"] = await ctx.fenced_async("account:1")
            seen["held2"] = held.token

    a = await app.enqueue_async("t.sync", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, a, JobState.SUCCEEDED)
        b = await app.enqueue_async("t.async", store=store)
        await job_in(store, b, JobState.SUCCEEDED)
    assert seen["job"] == 1
    assert seen["lease"] == seen["held"]
    assert seen["lease2"] == seen["held2"] > seen["held"]


async def test_a_released_resource_lease_no_longer_passes_its_check(app: App, store: Store) -> None:
    """Kept past its ``with`` block, a lease object's check() raises: the store has let
    the lease go and another holder may have it (sync and async handlers)."""
    errors: list[str] = []

    @app.task(name="t.sync_kept")
    def sync_kept(ctx: JobContext) -> None:
        with ctx.lease("r:1") as held:
            held.check()  # passes while held
        with pytest.raises(LeaseExpiredError) as info:
            held.check()
        errors.append(str(info.value))

    @app.task(name="t.async_kept")
    async def async_kept(ctx: JobContext) -> None:
        async with ctx.lease("r:2") as held:
            held.check()
        with pytest.raises(LeaseExpiredError) as info:
            held.check()
        errors.append(str(info.value))

    ids = [await app.enqueue_async(t, store=store) for t in ("t.sync_kept", "t.async_kept")]
    async with running(Worker(app, FAST)):
        for jid in ids:
            await job_in(store, jid, JobState.SUCCEEDED)
    assert sorted(errors) == [
        f"lease on 'r:{n}' (token 1) was released when its ctx.lease block ended" for n in (1, 2)
    ]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_lost_resource_lease_ends_only_its_own_attempt(
    app: App, store: Store, kind: str
) -> None:
    """An operator releases the resource lease one job holds (as `tokenline lease
    release` does; a takeover is refused the same way): that attempt ends and its job
    runs again, while another job on the same worker goes on undisturbed, on its first
    attempt: the worker is not fenced. It used to be, cancelling every job it ran."""
    holding, rerun = threading.Event(), threading.Event()
    runs: list[int] = []
    other_runs: list[int] = []
    fast_retry = RetryPolicy(base=0.001, cap=0.001)

    def hold_until_lost(held: Any) -> None:
        holding.set()
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            time.sleep(0.01)
            held.check()  # raises once the renewal is refused

    if kind == "sync":

        @app.task(name="t.hold", retry=fast_retry)
        def hold(ctx: JobContext) -> None:
            runs.append(ctx.token)
            if len(runs) > 1:
                rerun.set()
                return
            with ctx.lease("account:42") as held:
                hold_until_lost(held)

    else:

        @app.task(name="t.hold", retry=fast_retry)
        async def ahold(ctx: JobContext) -> None:
            runs.append(ctx.token)
            if len(runs) > 1:
                rerun.set()
                return
            async with ctx.lease("account:42") as held:
                await asyncio.to_thread(hold_until_lost, held)

    @app.task(name="t.other")
    def other(ctx: JobContext) -> None:
        other_runs.append(ctx.token)
        deadline = time.monotonic() + DEADLINE
        while not rerun.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
            ctx.check()  # JobCancelled here if the worker fenced itself

    hold_id = await app.enqueue_async("t.hold", store=store)
    other_id = await app.enqueue_async("t.other", store=store)
    # Job leases long enough that a stalled loop on a loaded machine never fences the
    # worker by its own clock (this is about a resource lease lost, not a job's): the
    # renewal that finds the resource lease gone still comes every 0.15 s.
    worker = Worker(app, dataclasses.replace(FAST, lease_ttl=6.0))
    async with running(worker):
        assert await asyncio.to_thread(holding.wait, DEADLINE), worker.counters
        (lease,) = [r for r in await store.resource_leases_list() if r.resource == "account:42"]
        assert await store.resource_lease_release(lease=lease)
        held = await job_in(store, hold_id, JobState.SUCCEEDED)
        done = await job_in(store, other_id, JobState.SUCCEEDED)
    assert len(runs) == 2, runs
    assert held.attempt == 1  # the lost lease gave its attempt back
    assert (len(other_runs), done.attempt) == (1, 1), (other_runs, done.last_error)
    assert worker.counters.fenced == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_resource_lease_left_held_is_released_when_its_attempt_ends(
    app: App, store: Store, kind: str
) -> None:
    """A handler that takes a lease and never leaves its block: once the attempt is
    over the worker gives the lease back, and another holder can take it long before
    its TTL (it used to stay held all that time); the kept lease object refuses."""
    kept: list[Any] = []

    if kind == "sync":

        @app.task(name="t.leak")
        def leak(ctx: JobContext) -> None:
            kept.append(ctx.lease("res:leak", ttl=60).__enter__())

    else:

        @app.task(name="t.leak")
        async def aleak(ctx: JobContext) -> None:
            kept.append(await ctx.lease("res:leak", ttl=60).__aenter__())

    jid = await app.enqueue_async("t.leak", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, jid, JobState.SUCCEEDED)

        async def taken() -> None:
            # Polling: the store has no event for a release.
            while not await store.resource_lease_acquire(resource="res:leak", owner="b", ttl=1):  # noqa: ASYNC110
                await asyncio.sleep(0.02)

        await asyncio.wait_for(taken(), DEADLINE)
    with pytest.raises(LeaseExpiredError):
        kept[0].check()


async def test_the_control_plane_renews_a_held_resource_lease(app: App, store: Store) -> None:
    """A lease held longer than its TTL stays valid: each renewal tick extends it."""
    held_info: list[tuple[float, float]] = []

    @app.task(name="t.hold")
    def handler(ctx: JobContext) -> None:
        with ctx.lease("r", ttl=0.5) as held:
            first = held.expires_at
            time.sleep(1.2)
            ctx.check()  # still trusted: renewed meanwhile
            held_info.append((first, held.expires_at))

    jid = await app.enqueue_async("t.hold", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, jid, JobState.SUCCEEDED)
    ((first, last),) = held_info
    assert last > first + 0.5
    assert await store.resource_lease_acquire(resource="r", owner="next", ttl=1) is not None


def test_a_lease_ttl_below_three_renewal_intervals_is_refused(app: App) -> None:
    """The control plane could not keep such a lease: a clear error at ctx.lease."""
    from tokenline.worker.context import JobContext as Ctx

    with pytest.raises(InvalidInputError, match="three renewal intervals"):
        Ctx.resource_lease(_ctx_stub(), "r", ttl=0.3)


@pytest.mark.parametrize("ttl", [86_400.5, 1e308, 10**400, float("inf"), float("nan")])
def test_a_lease_ttl_beyond_the_longest_lease_ttl_is_refused(app: App, ttl: float) -> None:
    """Regression: a resource lease must expire once its holder is dead, so its ttl is
    bounded like lease_ttl (at most a day); 1e308 or 10**400 used to be taken."""
    from tokenline.worker.context import JobContext as Ctx

    with pytest.raises(InvalidInputError, match="at most 86400"):
        Ctx.resource_lease(_ctx_stub(), "r", ttl=ttl)
    Ctx.resource_lease(_ctx_stub(), "r", ttl=86_400)  # the bound itself is fine


@pytest.mark.parametrize("wait", [float("inf"), float("nan"), -1])
def test_a_lease_wait_that_is_not_finite_is_refused(app: App, wait: float) -> None:
    """Regression: ctx.lease(wait=inf) was taken, and would wait for ever under
    contention (ctx.effect's wait was already refused)."""
    from tokenline.worker.context import JobContext as Ctx

    with pytest.raises(InvalidInputError, match="finite number of seconds"):
        Ctx.resource_lease(_ctx_stub(), "r", wait=wait)
    Ctx.resource_lease(_ctx_stub(), "r", wait=10**6)  # long, but it ends


def _ctx_stub() -> Any:
    class Stub:
        _settings = FAST
        _slot = type("S", (), {"resources": []})()

    return Stub()


def test_require_fenced_raises_on_zero_rows() -> None:
    """A fenced UPDATE that matched no row means a newer token wrote first."""
    require_fenced(1, resource="accounts 42", token=3)
    with pytest.raises(StaleTokenError, match="accounts 42"):
        require_fenced(0, resource="accounts 42", token=3)


@pytest.mark.parametrize("wait", [math.inf, math.nan, -1, 10**400, True, "5"])
def test_an_effect_wait_that_is_not_a_finite_number_of_seconds_is_refused(wait: Any) -> None:
    """Regression: ``wait=math.inf`` was taken, then the claim gave up at once instead of
    waiting; an endless wait would outlive the attempt anyway. 10**400 raised an
    OverflowError of its own."""
    lease = Lease(1, "w", 1, 0.0)
    with pytest.raises(InvalidInputError, match="wait must be a finite number of seconds"):
        EffectRun(MemoryStore(), lease, "k", clock=FakeClock(), wait=wait)
    assert EffectRun(MemoryStore(), lease, "k", clock=FakeClock(), wait=86_400).wait == 86_400


@pytest.mark.parametrize("call", ["fenced", "effect"])
async def test_an_async_handler_that_forgets_await_is_dead_not_succeeded(
    app: App, store: Store, call: str
) -> None:
    """``ctx.fenced``/``ctx.effect`` in an async handler return a coroutine: without
    ``await`` the fence is never written and the effect never runs. The job used to
    succeed all the same, with only a RuntimeWarning at garbage collection; it is now
    dead at once (a bug in the handler), naming the call, and nothing warns."""
    ran: list[int] = []

    @app.task(name="t.forgot")
    async def forgot(ctx: JobContext) -> None:
        if call == "fenced":
            ctx.fenced("invoice:1")
        else:
            ctx.effect("mail:1", ran.append, 1)

    @app.task(name="t.awaited")
    async def awaited(ctx: JobContext) -> None:
        for n in range(100):  # past the list's pruning: awaited calls are let go
            await ctx.fenced(f"k:{n}")
        await ctx.effect("mail:2", ran.append, 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "never awaited" RuntimeWarning fails the test
        bad = await app.enqueue_async("t.forgot", store=store)
        good = await app.enqueue_async("t.awaited", store=store)
        async with running(Worker(app, FAST)):
            dead = await job_in(store, bad, JobState.DEAD)
            await job_in(store, good, JobState.SUCCEEDED)
        gc.collect()
    assert f"ctx.{call} without `await`" in (dead.last_error or ""), dead.last_error
    assert (dead.attempt, dead.error_class) == (1, "permanent")
    assert ran == [2]
