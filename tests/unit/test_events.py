"""The core's typed event stream: what the worker reports, and what it costs unheard."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator
from typing import TypeVar

import pytest

from tokenline import App, FakeClock, JobContext, JobState, Permanent, Worker, events
from tokenline.stores import MemoryStore, Store
from unit.test_worker import FAST, NO_BACKOFF, QUIET, _zombie_setup, eventually, job_in, running


@pytest.fixture
def heard() -> Iterator[list[events.Event]]:
    """Every event emitted while the test runs."""
    seen: list[events.Event] = []
    events.add_hook(seen.append)
    try:
        yield seen
    finally:
        events.remove_hook(seen.append)


@pytest.fixture
def app() -> App:
    """An in-memory app on the real clock."""
    return App("memory://")


@pytest.fixture
def store(app: App) -> Store:
    """The app's (shared) in-memory store."""
    return app.open_store()


E = TypeVar("E", bound=events.Event)


def of(kind: type[E], seen: list[events.Event]) -> list[E]:
    """The events of ``kind`` among ``seen``."""
    return [e for e in seen if isinstance(e, kind)]


def test_hooks_are_added_once_removed_and_a_failing_hook_is_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """add_hook is idempotent, remove_hook forgets, and a hook that raises is logged
    without keeping the event from the others."""
    got: list[events.Event] = []

    def broken(event: events.Event) -> None:
        raise RuntimeError("boom")

    assert not events.enabled()
    events.add_hook(broken)
    events.add_hook(got.append)
    events.add_hook(got.append)
    try:
        assert events.enabled()
        with caplog.at_level(logging.ERROR, logger="tokenline.events"):
            events.emit(events.StaleRead("w", "job lease", "x"))
        assert got == [events.StaleRead("w", "job lease", "x")]
        assert "event hook" in caplog.text
        assert "boom" in caplog.text
    finally:
        events.remove_hook(broken)
        events.remove_hook(got.append)
    assert not events.enabled()
    events.remove_hook(got.append)  # removing again is harmless


async def test_a_job_reports_its_start_and_outcome(
    app: App, store: Store, heard: list[events.Event]
) -> None:
    """Start and finish carry the job, task, queue, attempt and token; the finish its
    outcome and duration; the worker's state changes come through too."""

    @app.task(name="t.ev_ok", queue="billing")
    async def ok(ctx: JobContext) -> None:
        pass

    jid = await app.enqueue_async("t.ev_ok", store=store)
    worker = Worker(app, dataclasses.replace(FAST, queues=("billing",)))
    async with running(worker):
        await job_in(store, jid, JobState.SUCCEEDED)
        await eventually(lambda: bool(of(events.JobFinished, heard)), "the finish is heard")
    (started,) = of(events.JobStarted, heard)
    (finished,) = of(events.JobFinished, heard)
    assert isinstance(started, events.JobStarted)
    assert isinstance(finished, events.JobFinished)
    assert (started.worker_id, started.job_id, started.task, started.queue) == (
        worker.id,
        jid,
        "t.ev_ok",
        "billing",
    )
    assert (finished.job_id, finished.outcome, finished.attempt) == (jid, "succeeded", 1)
    assert finished.token == started.token
    assert finished.duration >= 0
    assert finished.waited >= 0
    changes = [(e.old, e.new) for e in of(events.WorkerStateChanged, heard)]
    assert ("ready", "processing") in changes
    assert changes[-1][1] == "stopped"


async def test_retries_and_dead_letters_report_their_class(
    app: App, store: Store, heard: list[events.Event]
) -> None:
    """A transient failure finishes as ``retry``, then ``dead``; a Permanent one as
    ``dead`` at once, each with its error class."""

    @app.task(name="t.ev_flaky", max_attempts=2, retry=NO_BACKOFF)
    async def flaky(ctx: JobContext) -> None:
        raise ConnectionResetError("peer reset")

    @app.task(name="t.ev_bad")
    async def bad(ctx: JobContext) -> None:
        raise Permanent("invalid invoice")

    flaky_id = await app.enqueue_async("t.ev_flaky", store=store)
    bad_id = await app.enqueue_async("t.ev_bad", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, flaky_id, JobState.DEAD)
        await job_in(store, bad_id, JobState.DEAD)
        await eventually(lambda: len(of(events.JobFinished, heard)) == 3, "3 outcomes")
    outcomes = sorted(
        (e.job_id, e.attempt, e.outcome, e.error_class) for e in of(events.JobFinished, heard)
    )
    assert outcomes == sorted(
        [
            (flaky_id, 1, "retry", "transient"),
            (flaky_id, 2, "dead", "transient"),
            (bad_id, 1, "dead", "permanent"),
        ]
    )


async def test_a_zombie_commit_reports_a_stale_commit_and_a_stale_read(
    heard: list[events.Event],
) -> None:
    """The store refusing a worker's commit is heard as a refused stale commit and as a
    stale read of the worker's own view of its lease."""
    app, store, _, _ = _zombie_setup(unsafe=False)
    (jid,) = await store.jobs_enqueue(jobs=[app.build_job("t.victim")])
    worker = Worker(app, QUIET, store=store)
    async with running(worker):
        await eventually(lambda: bool(of(events.StaleCommitRefused, heard)), "the refusal")
    (refused,) = of(events.StaleCommitRefused, heard)
    assert isinstance(refused, events.StaleCommitRefused)
    assert (refused.worker_id, refused.job_id, refused.operation) == (worker.id, jid, "succeeded")
    assert [e.view for e in of(events.StaleRead, heard)] == ["job lease"]
    assert not of(events.JobFinished, heard)


async def test_a_refused_renewal_is_heard(heard: list[events.Event]) -> None:
    """A renewal the store refuses (the job was rescued under the worker) is reported
    with the number of jobs lost."""
    store_clock = FakeClock()
    app = App("memory://", clock=FakeClock())
    store = MemoryStore(clock=store_clock)
    blocked = asyncio.Event()

    @app.task(name="t.ev_slow")
    async def slow(ctx: JobContext) -> None:
        store_clock.advance(FAST.lease_ttl + 1)
        await store.jobs_rescue()
        await blocked.wait()

    await store.jobs_enqueue(jobs=[app.build_job("t.ev_slow")])
    # One slot: the rescued job cannot be claimed again by this worker meanwhile.
    one = dataclasses.replace(FAST, concurrency=1)
    async with running(Worker(app, one, store=store)):
        await eventually(lambda: bool(of(events.LeaseRenewalFailed, heard)), "the refusal")
        blocked.set()
    failed = of(events.LeaseRenewalFailed, heard)[0]
    assert isinstance(failed, events.LeaseRenewalFailed)
    assert (failed.jobs, failed.reason) == (1, "refused")


async def test_an_effect_repeated_is_heard_as_a_duplicate_execution(
    app: App, store: Store, heard: list[events.Event]
) -> None:
    """ctx.effect of a key that already completed returns the stored result and is heard
    as a duplicate execution, with the key."""
    calls: list[int] = []

    @app.task(name="t.ev_effect")
    async def effect(ctx: JobContext) -> None:
        await ctx.effect("receipt:1", calls.append, 1)

    first = await app.enqueue_async("t.ev_effect", store=store)
    second = await app.enqueue_async("t.ev_effect", store=store)
    async with running(Worker(app, FAST)):
        await job_in(store, first, JobState.SUCCEEDED)
        await job_in(store, second, JobState.SUCCEEDED)
    assert calls == [1]
    (dup,) = of(events.DuplicateExecution, heard)
    assert isinstance(dup, events.DuplicateExecution)
    assert (dup.key, dup.kind) == ("receipt:1", "repeat")


async def test_nobody_listening_builds_no_event(
    app: App, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a hook, the worker does not even build the events: the stream costs a
    flag check."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an event was built with nobody listening")

    for name in ("JobStarted", "JobFinished", "WorkerStateChanged", "Heartbeat"):
        monkeypatch.setattr(events, name, refuse)

    @app.task(name="t.ev_quiet")
    async def quiet(ctx: JobContext) -> None:
        pass

    jid = await app.enqueue_async("t.ev_quiet", store=store)
    worker = Worker(app, FAST)
    async with running(worker):
        await job_in(store, jid, JobState.SUCCEEDED)
        await eventually(lambda: worker.counters.succeeded == 1, "the success is counted")
