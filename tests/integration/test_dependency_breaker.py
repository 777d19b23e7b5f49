"""A dependency that starts timing out, then heals, under two workers sharing one store:
the breaker opens within its window, calls to the dependency drop, no job is
dead-lettered, attempts are spent only by calls that really timed out (never by a job
held back), and every job completes once the dependency answers again."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tokenline import App, JobContext, JobState, RetryPolicy, Worker, WorkerSettings, events
from tokenline.backpressure import BreakerState
from tokenline.dependencies import read_shared
from tokenline.stores import Store

DEP = "payments-api"
#: The retry budget's window is cut from 60 s: retries it holds back would wait that long.
SETTINGS = WorkerSettings(
    lease_ttl=3, renew_interval=0.5, poll_interval=0.05, concurrency=4, retry_budget_window=5.0
)
#: The dependency answers in 10 ms when healthy; sick, it hangs past its 0.2 s timeout.
TIMEOUT, HANG = 0.2, 1.0
WINDOW, OPEN_FOR, MIN_CALLS = 5.0, 1.0, 5
DEADLINE = 60.0


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store of each kind (each worker opens its own handle on it)."""
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'breaker.db'}"
    else:
        import psycopg

        server: str = request.getfixturevalue("postgres_server")
        schema = f"tl_br_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        yield f"{server}?schema={schema}&options=-c%20search_path%3D{schema}"
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


class Api:
    """The dependency: a flag the test flips, and the time of every call it got."""

    def __init__(self) -> None:
        self.sick = False
        self.calls: list[float] = []

    async def charge(self) -> None:
        self.calls.append(time.monotonic())
        await asyncio.sleep(HANG if self.sick else 0.01)

    def rate(self, start: float, end: float) -> float:
        """Calls per second received between two monotonic times."""
        return sum(start <= t < end for t in self.calls) / (end - start)


@contextlib.asynccontextmanager
async def workers(app: App, n: int) -> AsyncIterator[list[Worker]]:
    fleet = [Worker(app, SETTINGS, worker_id=f"w{i}") for i in range(n)]
    tasks = [asyncio.create_task(w.run()) for w in fleet]
    try:
        yield fleet
    finally:
        for w in fleet:
            w.request_shutdown()
            w.request_shutdown()
        await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE)


async def until(
    what: str, check: collections.abc.Callable[[], collections.abc.Awaitable[bool]]
) -> float:
    """Poll ``check`` until it holds; the monotonic time it first did."""
    deadline = time.monotonic() + DEADLINE
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)
    return time.monotonic()


async def test_a_dependency_that_times_out_then_heals(url: str) -> None:
    """Healthy, then hanging past its timeout, then healthy again (module docstring)."""
    app = App(url)
    app.dependency(
        DEP,
        timeout=TIMEOUT,
        failure_rate=0.5,
        min_calls=MIN_CALLS,
        window=WINDOW,
        open_for=OPEN_FOR,
    )
    api = Api()
    timed_out: collections.Counter[int] = collections.Counter()

    @app.task(
        name="t.charge",
        depends_on=[DEP],
        max_attempts=25,
        retry=RetryPolicy(base=0.05, cap=0.2),
    )
    async def charge(ctx: JobContext) -> None:
        try:
            async with ctx.dependency(DEP):
                await api.charge()
        except TimeoutError:
            timed_out[ctx.job_id] += 1
            raise

    heard: list[tuple[float, events.Event]] = []

    def hear(e: events.Event) -> None:
        if isinstance(e, events.DependencyCall | events.BreakerChanged):
            heard.append((time.monotonic(), e))

    store = app.open_store()
    await store.open()
    events.add_hook(hear)
    try:
        async with workers(app, 2) as fleet:

            async def finished(ids: list[int]) -> bool:
                jobs = [await store.job_get(job_id=j) for j in ids]
                return all(j.state is JobState.SUCCEEDED for j in jobs)

            async def breaker_open() -> bool:
                return await _shared_state(store) is BreakerState.OPEN

            healthy = [await app.enqueue_async("t.charge", store=store) for _ in range(20)]
            await until("the healthy jobs succeed", lambda: finished(healthy))

            api.sick = True
            sick_at = time.monotonic()
            ids = [await app.enqueue_async("t.charge", store=store) for _ in range(80)]
            await until("the breaker opens", breaker_open)
            await asyncio.sleep(3.0)
            sick_until = time.monotonic()
            api.sick = False
            healed_at = time.monotonic()
            done_at = await until("every job succeeds", lambda: finished(ids))
            deferred = sum(w.counters.deferred for w in fleet)
    finally:
        events.remove_hook(hear)
    jobs = [await store.job_get(job_id=j) for j in ids]
    dead = await store.jobs_list(state=JobState.DEAD, limit=100)
    await store.close()

    # The breaker opened within its window of the first timeout: both read from the
    # workers' own events, so the test's own enqueues and polls, slow on a loaded
    # machine, are not counted in.
    first_timeout = min(
        t
        for t, e in heard
        if isinstance(e, events.DependencyCall) and e.outcome == "timeout" and t >= sick_at
    )
    first_open = min(
        t
        for t, e in heard
        if isinstance(e, events.BreakerChanged) and e.new == "open" and t >= sick_at
    )
    assert first_open - first_timeout < WINDOW
    # Calls fell once it opened, from every slot of both workers to a trial now and
    # then: at most one per worker per OPEN_FOR (twice that, for slack). A bound set by
    # the breaker, not by the machine's speed: a slow machine only calls less.
    before = api.rate(sick_at, first_open)
    after = api.rate(first_open + 0.5, sick_until)
    assert after <= 2 * 2 / OPEN_FOR, (before, after)
    # No job went dead, and attempts were spent only by calls that timed out: a job
    # held back by the breaker (given back before it ran, or refused in its handler)
    # kept its attempt.
    assert dead == []
    assert deferred > 0
    for job in jobs:
        assert job.attempt == 1 + timed_out[job.id], job
    # Each worker's breaker left closed and ended closed; at least one went through
    # open. A worker that reads the shared breaker only once its open time is over
    # (its view is refreshed every few seconds, later under load) takes it up
    # half-open, as it is then: closed, half-open, closed is its whole path.
    changes = [e for _, e in heard if isinstance(e, events.BreakerChanged)]
    paths = {w: [e.new for e in changes if e.worker_id == w] for w in ("w0", "w1")}
    for path in paths.values():
        assert {"open", "half_open"} & set(path), paths
        assert path[-1] == "closed", paths
    assert any("open" in path for path in paths.values()), paths
    outcomes = collections.Counter(
        e.outcome for _, e in heard if isinstance(e, events.DependencyCall)
    )
    print(
        f"\n{url.split(':')[0]}: opened {first_open - first_timeout:.2f}s after the first "
        "timeout; "
        f"calls/s {before:.1f} before it opened, {after:.2f} while open; "
        f"{sum(timed_out.values())} attempts spent on timeouts for {len(ids)} jobs; "
        f"{deferred} deferrals; all done {done_at - healed_at:.2f}s after healing; "
        f"outcomes {dict(outcomes)}"
    )


async def _shared_state(store: Store) -> BreakerState:
    shared = read_shared(await store.resource_leases_list(), await store.store_time())
    return shared[DEP].state if DEP in shared else BreakerState.CLOSED
