"""The store contract: every backend must pass every test here unchanged."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline._errors import JobNotFoundError, NotSupportedError, StaleTokenError
from tokenline._jobs import (
    MAX_ERROR_LENGTH,
    Finish,
    JobState,
    Lease,
    NewJob,
    Outcome,
    Unique,
    WorkerRecord,
)

Q = ["default"]


def new(task: str = "t", **kw: Any) -> NewJob:
    return NewJob(queue=kw.pop("queue", "default"), task=task, args="[]", **kw)


async def claim_one(store: Any, owner: str = "w1", ttl: float = 10.0) -> Any:
    (claimed,) = await store.jobs_claim(owner=owner, queues=Q, limit=1, ttl=ttl)
    return claimed


async def test_enqueue_returns_ids_and_jobs_start_queued(store: Any) -> None:
    """Enqueued jobs get distinct ids in order and start queued with attempt 0."""
    ids = await store.jobs_enqueue(jobs=[new(), new(), new()])
    assert len(set(ids)) == 3
    assert ids == sorted(ids)
    job = await store.job_get(job_id=ids[0])
    assert job.state is JobState.QUEUED
    assert job.attempt == 0
    assert job.lease_token == 0


async def test_enqueue_many_is_all_or_nothing_and_empty_is_noop(store: Any) -> None:
    """An empty batch inserts nothing and returns no ids."""
    assert await store.jobs_enqueue(jobs=[]) == []
    assert await store.jobs_list() == []


async def test_a_listing_may_ask_each_jobs_arguments_cut(store: Any) -> None:
    """Listings that show no arguments read each job's whole payload: eight dashboard
    requests for a queue of 30 MB jobs held 4.8 GB. A listing asks them cut to what it
    shows, never half a character; without a limit they are whole."""
    big = '["' + "é" * 3000 + '"]'
    (jid,) = await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args=big)])
    (whole,) = await store.jobs_list()
    assert whole.args == big
    (none,) = await store.jobs_list(args_limit=0)
    assert (none.id, none.args, none.task) == (jid, "", "t")
    (cut,) = await store.jobs_list(args_limit=101)
    assert 0 < len(cut.args) <= 101
    assert big.startswith(cut.args)
    assert (await store.job_get(job_id=jid)).args == big  # nothing stored was changed


@pytest.mark.parametrize("size", [2, 100])
async def test_whole_and_fractional_seconds_mix_in_one_batch(store: Any, size: int) -> None:
    """Seconds given as ``int`` beside ``float`` in one batch (a task's ``timeout=30``
    beside another's 0.5, a retry delay of 5 beside 0.5): the batch goes in, and so do
    finishes batched the same way. PostgreSQL's binary arrays refused such a batch
    whole, a worker's batch of finishes with it."""
    jobs = [new(timeout=30 if i % 2 else 0.5, delay=0 if i % 2 else 0.0) for i in range(size)]
    ids = await store.jobs_enqueue(jobs=jobs)
    assert [(await store.job_get(job_id=i)).timeout for i in ids[:2]] == [0.5, 30.0]
    a, b = await store.jobs_claim(owner="w1", queues=Q, limit=2, ttl=10)
    finishes = [
        Finish(a.lease, Outcome.RETRY, 0.5, "x", "transient"),
        Finish(b.lease, Outcome.RETRY, 5, "y", "transient"),
    ]
    assert await store.jobs_finish(finishes=finishes) == [True, True]


async def test_opening_an_open_store_again_keeps_it_and_leaks_nothing(store: Any) -> None:
    """A worker handed an open store opens it again: the store keeps its data and its
    connections, and one close releases them all (a second client, opened over the
    first, was left for the garbage collector to report unclosed)."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    await store.open()
    await store.open()
    assert (await store.job_get(job_id=jid)).state is JobState.QUEUED
    await store.close()
    gc.collect()


async def test_job_get_unknown_raises(store: Any) -> None:
    """Asking for a job that does not exist is a clear JobNotFoundError."""
    with pytest.raises(JobNotFoundError, match="12345"):
        await store.job_get(job_id=12345)


async def test_claim_orders_by_priority_then_run_at(store: Any, clock: FakeClock) -> None:
    """Higher priority first, then older run_at, then lower id."""
    low = (await store.jobs_enqueue(jobs=[new(priority=0)]))[0]
    clock.advance(1)
    high = (await store.jobs_enqueue(jobs=[new(priority=5)]))[0]
    mid = (await store.jobs_enqueue(jobs=[new(priority=1)]))[0]
    got = await store.jobs_claim(owner="w", queues=Q, limit=10, ttl=10)
    assert [c.job.id for c in got] == [high, mid, low]


async def test_claim_issues_lease_with_store_time_and_increments(
    store: Any, clock: FakeClock
) -> None:
    """A claim moves the job to running, bumps attempt and token, and sets expiry."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    c = await claim_one(store, ttl=7)
    assert c.job.id == jid
    assert c.job.state is JobState.RUNNING
    assert c.job.attempt == 1
    assert c.lease.token == 1
    assert c.lease.owner == "w1"
    assert c.lease.expires_at == pytest.approx(clock.now() + 7)
    assert await store.jobs_claim(owner="w2", queues=Q, limit=1, ttl=7) == []


async def test_delayed_job_is_scheduled_until_run_at(store: Any, clock: FakeClock) -> None:
    """A job with run_at in the future is not claimable until then."""
    (jid,) = await store.jobs_enqueue(jobs=[new(run_at=clock.now() + 30)])
    assert (await store.job_get(job_id=jid)).state is JobState.SCHEDULED
    assert await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=5) == []
    clock.advance(30)
    assert [c.job.id for c in await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=5)] == [jid]


async def test_claim_only_from_requested_and_unpaused_queues(store: Any) -> None:
    """Claims filter by queue and skip paused queues until resumed."""
    await store.jobs_enqueue(jobs=[new(queue="a"), new(queue="b")])
    await store.queue_pause(queue="a")
    got = await store.jobs_claim(owner="w", queues=["a"], limit=5, ttl=5)
    assert got == []
    stats = {s.queue: s for s in await store.queues_stats()}
    assert stats["a"].paused
    assert not stats["b"].paused
    await store.queue_resume(queue="a")
    got = await store.jobs_claim(owner="w", queues=["a"], limit=5, ttl=5)
    assert [c.job.queue for c in got] == ["a"]


async def test_renew_extends_only_held_leases(store: Any, clock: FakeClock) -> None:
    """Renewal extends held leases; a wrong token or owner gets None and is recorded."""
    await store.jobs_enqueue(jobs=[new(), new()])
    a, b = await store.jobs_claim(owner="w1", queues=Q, limit=2, ttl=10)
    clock.advance(5)
    forged = Lease(b.lease.job_id, "w1", b.lease.token + 7, b.lease.expires_at)
    out = await store.job_leases_renew(owner="w1", leases=[a.lease, forged], ttl=10)
    assert out[0] is not None
    assert out[0].expires_at == pytest.approx(clock.now() + 10)
    assert out[1] is None
    other = await store.job_leases_renew(owner="w2", leases=[a.lease], ttl=10)
    assert other == [None]
    total, recent = await store.stale_commits()
    assert total == 2
    assert {r.operation for r in recent} == {"renew"}


async def test_renew_refuses_an_expired_lease(store: Any, clock: FakeClock) -> None:
    """Ownership expires: a lease past its TTL cannot be renewed back to life."""
    await store.jobs_enqueue(jobs=[new()])
    c = await claim_one(store, ttl=5)
    clock.advance(5.01)
    assert await store.job_leases_renew(owner="w1", leases=[c.lease], ttl=5) == [None]


@pytest.mark.parametrize("outcome", list(Outcome))
async def test_every_finalising_write_refuses_a_stale_token(
    store: Any, clock: FakeClock, outcome: Outcome
) -> None:
    """After a rescue and re-claim, the old token's write is refused for every outcome."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    old = await claim_one(store, "w1", ttl=5)
    clock.advance(6)
    await store.jobs_rescue()
    new_claim = await claim_one(store, "w2", ttl=5)
    assert new_claim.lease.token > old.lease.token
    ok = await store.jobs_finish(finishes=[Finish(old.lease, outcome, 0.0, "e", "x")])
    assert ok == [False]
    job = await store.job_get(job_id=jid)
    assert job.state is JobState.RUNNING
    assert job.lease_owner == "w2"
    total, recent = await store.stale_commits()
    assert total == 1
    assert recent[0].token == old.lease.token
    assert recent[0].job_id == jid
    # The current holder still commits.
    assert await store.jobs_finish(finishes=[Finish(new_claim.lease, Outcome.SUCCEEDED)]) == [True]


async def test_singular_helpers_raise_stale_token_error(store: Any) -> None:
    """job_complete with a forged token raises StaleTokenError naming the job."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    c = await claim_one(store)
    forged = Lease(jid, "w1", c.lease.token + 1, c.lease.expires_at)
    with pytest.raises(StaleTokenError, match=f"job {jid}"):
        await store.job_complete(lease=forged)
    await store.job_complete(lease=c.lease)


async def test_a_finished_job_never_runs_again(store: Any) -> None:
    """Monotonic states: a succeeded job is not claimable and a second commit fails."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    c = await claim_one(store)
    await store.job_complete(lease=c.lease)
    assert (await store.job_get(job_id=jid)).state is JobState.SUCCEEDED
    assert await store.jobs_claim(owner="w", queues=Q, limit=5, ttl=5) == []
    assert await store.jobs_finish(finishes=[Finish(c.lease, Outcome.RETRY)]) == [False]
    report = await store.jobs_rescue()
    assert (list(report.requeued), list(report.dead)) == ([], [])
    assert await store.jobs_retry_dead(job_ids=[jid]) == 0
    assert (await store.job_get(job_id=jid)).state is JobState.SUCCEEDED


async def test_delays_are_durations_from_the_store_clock(store: Any, clock: FakeClock) -> None:
    """An enqueue delay and a retry delay are added to the store's own now: the job
    becomes ready exactly that long later by the store's clock, whoever sent it."""
    (jid,) = await store.jobs_enqueue(jobs=[new(delay=20)])
    job = await store.job_get(job_id=jid)
    assert (job.state, job.run_at) == (JobState.SCHEDULED, pytest.approx(clock.now() + 20))
    clock.advance(19.5)
    assert await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=5) == []
    clock.advance(0.5)
    c = await claim_one(store)
    await store.job_retry(lease=c.lease, delay=7, error="later")
    assert (await store.job_get(job_id=jid)).run_at == pytest.approx(clock.now() + 7)
    clock.advance(6.9)
    assert await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=5) == []
    clock.advance(0.1)
    assert (await claim_one(store)).job.id == jid


async def test_retry_burns_an_attempt_and_release_gives_it_back(
    store: Any, clock: FakeClock
) -> None:
    """RETRY keeps the attempt count; RELEASE refunds it; both requeue the job."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    c = await claim_one(store)
    await store.job_retry(lease=c.lease, delay=10, error="boom")
    job = await store.job_get(job_id=jid)
    assert job.state is JobState.SCHEDULED
    assert job.attempt == 1
    assert job.last_error == "boom"
    clock.advance(10)
    c2 = await claim_one(store)
    assert c2.job.attempt == 2
    await store.job_snooze(lease=c2.lease, delay=0)
    job = await store.job_get(job_id=jid)
    assert job.state is JobState.QUEUED
    assert job.attempt == 1
    c3 = await claim_one(store)
    assert c3.lease.token == 3


async def test_any_error_text_from_user_code_is_kept_readable_and_bounded(store: Any) -> None:
    """An exception's message may hold NUL (PostgreSQL refuses it), lone surrogates
    (no store can encode them) or megabytes: the finish is still accepted, and the job
    keeps the text escaped and cut, so a bad message can never block its job's commit."""
    ids = await store.jobs_enqueue(jobs=[new(), new(), new()])
    texts = ["ValueError: a\x00b", "ValueError: bad \udcff surrogate", "x" * 3_000_000]
    claimed = await store.jobs_claim(owner="w1", queues=Q, limit=3, ttl=10.0)
    finishes = [
        Finish(c.lease, Outcome.DEAD, None, text, "permanent")
        for c, text in zip(sorted(claimed, key=lambda c: c.job.id), texts, strict=True)
    ]
    assert await store.jobs_finish(finishes=finishes) == [True, True, True]
    nul, surrogate, huge = [await store.job_get(job_id=i) for i in ids]
    assert nul.state is JobState.DEAD
    assert nul.last_error == "ValueError: a\\x00b"
    assert surrogate.last_error == "ValueError: bad \\udcff surrogate"
    assert huge.last_error is not None
    assert len(huge.last_error) == MAX_ERROR_LENGTH
    assert huge.last_error.endswith("… (3000000 characters)")
    attempts = await store.job_attempts(job_id=ids[0])
    assert [a.error for a in attempts] == ["ValueError: a\\x00b"]


async def test_dead_job_can_be_retried_by_operator_only_to_queued(store: Any) -> None:
    """Dead-lettering records the reason; an operator retry requeues with fresh attempts."""
    (jid,) = await store.jobs_enqueue(jobs=[new(max_attempts=1)])
    c = await claim_one(store)
    await store.job_dead(lease=c.lease, error="invalid invoice")
    job = await store.job_get(job_id=jid)
    assert (job.state, job.last_error, job.error_class) == (
        JobState.DEAD,
        "invalid invoice",
        "permanent",
    )
    assert await store.jobs_retry_dead(job_ids=[jid]) == 1
    job = await store.job_get(job_id=jid)
    assert job.state is JobState.QUEUED
    assert job.max_attempts > job.attempt
    c2 = await claim_one(store)
    assert c2.lease.token > c.lease.token


IMPOSSIBLE_IDS = [2**63, 99999999999999999999999, 0, -1]


async def test_an_id_no_job_can_have_is_no_such_job(store: Any) -> None:
    """An id outside 1..2**63-1 (past 64 bits, say) is "no such job" for every call that
    takes ids; on SQLite it used to raise OverflowError, and a batch holding one such id
    retried none of the others."""
    (jid,) = await store.jobs_enqueue(jobs=[new(max_attempts=1)])
    c = await claim_one(store)
    await store.job_dead(lease=c.lease, error="invalid invoice")
    for bad in IMPOSSIBLE_IDS:
        with pytest.raises(JobNotFoundError):
            await store.job_get(job_id=bad)
        with pytest.raises(JobNotFoundError):
            await store.job_attempts(job_id=bad)
    assert await store.jobs_cancel(job_ids=IMPOSSIBLE_IDS, reason="nothing") == 0
    assert await store.jobs_retry_dead(job_ids=[jid, *IMPOSSIBLE_IDS]) == 1
    assert (await store.job_get(job_id=jid)).state is JobState.QUEUED


@pytest.mark.ledger
async def test_effects_of_an_impossible_job_id_are_none(store: Any) -> None:
    """The ledger's listing by job answers an impossible id with nothing."""
    for bad in IMPOSSIBLE_IDS:
        assert await store.effects_list(job_id=bad) == []


async def test_rescue_requeues_expired_leases_and_bumps_token(store: Any, clock: FakeClock) -> None:
    """An expired lease is returned to the queue with a new token; live ones stay."""
    await store.jobs_enqueue(jobs=[new(), new()])
    a = await claim_one(store, "w1", ttl=5)
    b = await claim_one(store, "w2", ttl=50)
    clock.advance(5)
    report = await store.jobs_rescue()
    assert list(report.requeued) == [a.job.id]
    assert list(report.dead) == []
    job = await store.job_get(job_id=a.job.id)
    assert job.state is JobState.QUEUED
    assert job.lease_token == a.lease.token + 1
    assert job.lease_owner is None
    assert (await store.job_get(job_id=b.job.id)).state is JobState.RUNNING
    attempts = await store.job_attempts(job_id=a.job.id)
    assert [(x.token, x.outcome) for x in attempts] == [(a.lease.token, "lease_expired")]


async def test_lost_lease_gives_the_attempt_back_and_counts_toward_its_own_limit(
    store: Any, clock: FakeClock
) -> None:
    """A lease that expires does not burn an attempt (a job with max_attempts=1 runs
    again) but counts toward max_lease_expiries; at that limit the job goes dead with
    the reason, so a job that kills every worker running it cannot loop forever."""
    (jid,) = await store.jobs_enqueue(jobs=[new(max_attempts=1, max_lease_expiries=2)])
    for expiry in (1, 2):
        claimed = await claim_one(store, owner=f"w{expiry}", ttl=1)
        assert claimed.job.attempt == 1
        clock.advance(2)
        report = await store.jobs_rescue()
        job = await store.job_get(job_id=jid)
        assert (job.attempt, job.lease_expiries) == (0, expiry)
    assert list(report.dead) == [jid]
    assert job.state is JobState.DEAD
    assert job.error_class == "coordination"
    assert job.last_error is not None
    assert "lost its lease 2 times" in job.last_error
    assert "w2" in job.last_error
    attempts = await store.job_attempts(job_id=jid)
    assert [a.outcome for a in attempts] == ["lease_expired", "lease_expired"]
    assert attempts[0].error is not None
    assert "lease expiry 1 of 2" in attempts[0].error
    assert await store.jobs_retry_dead(job_ids=[jid]) == 1
    assert (await store.job_get(job_id=jid)).lease_expiries == 0


async def test_a_rescued_job_keeps_its_place_in_the_queue(store: Any, clock: FakeClock) -> None:
    """A job whose worker died goes back ahead of the jobs enqueued after it (its run_at
    is kept), not behind the backlog that built up meanwhile."""
    (first,) = await store.jobs_enqueue(jobs=[new()])
    claimed = await claim_one(store, ttl=5)
    assert claimed.job.id == first
    clock.advance(1)
    later = await store.jobs_enqueue(jobs=[new(), new(), new()])
    clock.advance(5)
    assert list((await store.jobs_rescue()).requeued) == [first]
    job = await store.job_get(job_id=first)
    assert job.run_at == pytest.approx(claimed.job.run_at)
    got = await store.jobs_claim(owner="w2", queues=Q, limit=4, ttl=5)
    assert [c.job.id for c in got] == [first, *later]


async def test_attempt_history_keeps_tokens_and_outcomes(store: Any, clock: FakeClock) -> None:
    """Every attempt is recorded with its token, owner and outcome."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    c1 = await claim_one(store, "w1")
    await store.job_retry(lease=c1.lease, delay=0, error="flaky")
    c2 = await claim_one(store, "w2")
    await store.job_complete(lease=c2.lease)
    attempts = await store.job_attempts(job_id=jid)
    assert [(a.attempt, a.token, a.owner, a.outcome) for a in attempts] == [
        (1, 1, "w1", "retry"),
        (2, 2, "w2", "succeeded"),
    ]
    assert attempts[0].error == "flaky"


@pytest.mark.parametrize("spread", [False, True], ids=["one priority", "many priorities"])
async def test_concurrent_claimers_never_share_a_job(
    store_pair: tuple[Any, Any], spread: bool
) -> None:
    """Many concurrent claims over two connections hand out each (job, token) once:
    with one priority, and with seven under delayed jobs of a higher one (a claim then
    reads a priority at a time), where no delayed job is handed out."""
    a, b = store_pair
    if spread:
        await a.jobs_enqueue(jobs=[new(priority=9, delay=3600) for _ in range(40)])
    await a.jobs_enqueue(jobs=[new(priority=i % 7 if spread else 0) for i in range(60)])
    results = await asyncio.gather(
        *[
            (a if i % 2 else b).jobs_claim(owner=f"w{i}", queues=Q, limit=3, ttl=30)
            for i in range(30)
        ]
    )
    pairs = [(c.job.id, c.lease.token) for batch in results for c in batch]
    ids = [jid for jid, _ in pairs]
    assert len(ids) == 60
    assert len(set(ids)) == 60


async def test_cancel_only_touches_waiting_or_dead_jobs(store: Any) -> None:
    """Cancel moves queued jobs to cancelled and leaves running ones alone."""
    a, b = await store.jobs_enqueue(jobs=[new(), new()])
    c = await claim_one(store)
    assert await store.jobs_cancel(job_ids=[a, b], reason="operator") == 1
    states = {(await store.job_get(job_id=j)).state for j in (a, b)}
    assert states == {JobState.RUNNING, JobState.CANCELLED}
    await store.job_complete(lease=c.lease)


async def test_a_cancelled_dead_job_keeps_no_error_class(store: Any) -> None:
    """A dead job an operator cancelled showed "cancelled by an operator (permanent)":
    the reason was the operator's, the class its old failure's."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    c = await claim_one(store)
    await store.job_dead(lease=c.lease, error="card declined", error_class="permanent")
    assert (await store.job_get(job_id=jid)).error_class == "permanent"
    assert await store.jobs_cancel(job_ids=[jid], reason="cancelled by an operator") == 1
    job = await store.job_get(job_id=jid)
    assert (job.state, job.last_error, job.error_class) == (
        JobState.CANCELLED,
        "cancelled by an operator",
        None,
    )


async def test_stats_count_states_and_oldest_age(store: Any, clock: FakeClock) -> None:
    """Stats report counts per state and the age of the oldest ready job."""
    await store.jobs_enqueue(jobs=[new(), new()])
    clock.advance(4)
    await claim_one(store)
    (s,) = await store.queues_stats()
    assert s.count(JobState.QUEUED) == 1
    assert s.count(JobState.RUNNING) == 1
    assert s.oldest_ready_age == pytest.approx(4)


async def test_depth_counts_unfinished_jobs_per_queue_task_and_state(
    store: Any, clock: FakeClock
) -> None:
    """Depth counts queued, scheduled and running jobs per queue and task; a scheduled
    job whose time has come counts as queued; finished jobs are left out."""
    from tokenline.stores.base import Depth

    assert await store.jobs_depth() == []
    await store.jobs_enqueue(
        jobs=[
            new("a"),
            new("a"),
            new("b"),
            new("a", run_at=clock.now() + 5),
            new("a", run_at=clock.now() + 60),
            new("c", queue="other"),
        ]
    )
    done, running = await store.jobs_claim(owner="w", queues=Q, limit=2, ttl=30)
    await store.job_complete(lease=done.lease)
    clock.advance(10)
    assert await store.jobs_depth() == [
        Depth("default", "a", "queued", 1),
        Depth("default", "a", "running", 1),
        Depth("default", "a", "scheduled", 1),
        Depth("default", "b", "queued", 1),
        Depth("other", "c", "queued", 1),
    ]
    assert running.job.task == "a"


def _record(wid: str = "w-1") -> WorkerRecord:
    return WorkerRecord(wid, "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)


async def test_worker_membership_lease(store: Any, clock: FakeClock) -> None:
    """Heartbeats need the current token and an unexpired lease; re-registering bumps it."""
    rec = await store.worker_register(record=_record(), ttl=10)
    assert rec.token == 1
    hb = await store.worker_heartbeat(
        worker_id=rec.id, token=rec.token, state="processing", in_flight=2, ttl=10
    )
    assert hb is not None
    assert hb.state == "processing"
    assert hb.in_flight == 2
    assert (
        await store.worker_heartbeat(worker_id=rec.id, token=99, state="x", in_flight=0, ttl=10)
        is None
    )
    clock.advance(11)
    assert (
        await store.worker_heartbeat(
            worker_id=rec.id, token=rec.token, state="ready", in_flight=0, ttl=10
        )
        is None
    )
    again = await store.worker_register(record=_record(), ttl=10)
    assert again.token == 2
    await store.worker_deregister(worker_id=rec.id, token=again.token)
    (listed,) = await store.workers_list()
    assert listed.state == "stopped"


async def test_store_time_is_the_store_clock_and_heartbeats_carry_the_skew(
    store: Any, clock: FakeClock
) -> None:
    """store_time() reads the clock every lease and timestamp is measured by; the
    heartbeat stamps it and keeps the skew the worker reports (None keeps the last)."""
    assert await store.store_time() == pytest.approx(clock.now())
    clock.advance(5)
    assert await store.store_time() == pytest.approx(clock.now())
    rec = await store.worker_register(record=_record(), ttl=10)
    assert rec.heartbeat_at == pytest.approx(clock.now())
    assert rec.clock_skew is None
    beat = {"worker_id": rec.id, "token": rec.token, "state": "ready", "in_flight": 0, "ttl": 10}
    assert (await store.worker_heartbeat(**beat, skew=-3600.25)).clock_skew == -3600.25
    assert (await store.worker_heartbeat(**beat)).clock_skew == -3600.25
    (listed,) = await store.workers_list()
    assert listed.clock_skew == -3600.25


async def test_named_lease_is_exclusive_and_fenced(store: Any, clock: FakeClock) -> None:
    """One holder at a time; a new holder after expiry gets a higher token; release
    needs owner and token."""
    a = await store.resource_lease_acquire(resource="maint", owner="a", ttl=5)
    assert a is not None
    assert await store.resource_lease_acquire(resource="maint", owner="b", ttl=5) is None
    renewed = await store.resource_lease_acquire(resource="maint", owner="a", ttl=5)
    assert renewed is not None
    assert renewed.token == a.token
    clock.advance(6)
    b = await store.resource_lease_acquire(resource="maint", owner="b", ttl=5)
    assert b is not None
    assert b.token == a.token + 1
    assert not await store.resource_lease_release(lease=a)
    assert await store.resource_lease_release(lease=b)
    c = await store.resource_lease_acquire(resource="maint", owner="a", ttl=5)
    assert c is not None
    assert c.token == b.token + 1


@pytest.mark.ledger
async def test_fenced_transaction_commits_effect_with_completion(store: Any) -> None:
    """The business write and the completion commit together; a stale token writes
    nothing."""
    import inspect

    async def run(conn: Any, query: str, *params: Any) -> list[Any]:
        """Run ``query`` (``?`` placeholders) through whichever API ``conn`` has: the
        sync sqlite3 one or psycopg's async one."""
        if inspect.iscoroutinefunction(conn.execute):
            cur = await conn.execute(query.replace("?", "%s"), params)
            return list(await cur.fetchall()) if cur.description else []
        return list(conn.execute(query, params).fetchall())

    if not store.capabilities.transactional_completion:
        # A store without the capability must say so clearly, not half-work.
        await store.jobs_enqueue(jobs=[new()])
        c = await claim_one(store)
        with pytest.raises(NotSupportedError, match=r"ctx\.transaction"):
            store.fenced_transaction(lease=c.lease)
        return
    a, b = await store.jobs_enqueue(jobs=[new(), new()])
    ca = await claim_one(store)
    async with store.fenced_transaction(lease=ca.lease) as conn:
        await run(conn, "CREATE TABLE IF NOT EXISTS biz (job INTEGER)")
        await run(conn, "INSERT INTO biz VALUES (?)", a)
    assert (await store.job_get(job_id=a)).state is JobState.SUCCEEDED
    cb = await claim_one(store)
    stale = Lease(b, cb.lease.owner, cb.lease.token + 1, cb.lease.expires_at)
    with pytest.raises(StaleTokenError):
        async with store.fenced_transaction(lease=stale) as conn:
            await run(conn, "INSERT INTO biz VALUES (?)", b)

    async def write_then_fail() -> None:
        async with store.fenced_transaction(lease=cb.lease) as conn:
            await run(conn, "INSERT INTO biz VALUES (?)", b)
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError, match="handler failed"):
        await write_then_fail()
    assert (await store.job_get(job_id=b)).state is JobState.RUNNING
    async with store.fenced_transaction(lease=cb.lease) as conn:
        rows = await run(conn, "SELECT job FROM biz ORDER BY job")
    assert [r[0] for r in rows] == [a]


async def test_a_dead_job_retried_from_the_dlq_gets_a_fresh_budget(
    store: Any, clock: FakeClock
) -> None:
    """An operator's retry of a dead job resets its budget rather than extending it:
    attempt 0 of the job's own max_attempts, no lease expiries. The earlier attempts stay
    in the history, and the next claim's token is higher than every earlier one."""
    (jid,) = await store.jobs_enqueue(jobs=[new(max_attempts=3, max_lease_expiries=2)])
    tokens = []
    for _ in range(2):
        c = await claim_one(store)
        tokens.append(c.lease.token)
        await store.job_retry(lease=c.lease, delay=0, error="boom")
    c = await claim_one(store, ttl=1)
    tokens.append(c.lease.token)
    clock.advance(2)
    await store.jobs_rescue()
    c = await claim_one(store)
    tokens.append(c.lease.token)
    await store.job_dead(lease=c.lease, error="gave up")
    before = await store.job_get(job_id=jid)
    assert (before.attempt, before.lease_expiries) == (3, 1)
    assert await store.jobs_retry_dead(job_ids=[jid]) == 1
    job = await store.job_get(job_id=jid)
    assert (job.state, job.attempt, job.max_attempts, job.lease_expiries) == (
        JobState.QUEUED,
        0,
        3,
        0,
    )
    assert job.lease_token == before.lease_token
    again = await claim_one(store)
    assert (again.job.attempt, again.job.max_attempts) == (1, 3)
    assert again.lease.token > max(tokens)
    history = await store.job_attempts(job_id=jid)
    assert [a.token for a in history] == [*tokens, again.lease.token]
    await store.job_retry(lease=again.lease, delay=0, error="still failing")
    assert (await store.job_get(job_id=jid)).attempt == 1


async def test_worker_drain_marks_a_live_membership_and_the_heartbeat_returns_it(
    store: Any, clock: FakeClock
) -> None:
    """worker_drain marks a live worker's membership (True), which its next heartbeat
    and the workers listing return; asking again is harmless. The same worker
    registering again (fenced, or its membership lapsed while it was paused) keeps the
    mark: the operator's drain was lost there, and the worker went on claiming."""
    rec = await store.worker_register(record=_record(), ttl=10)
    assert rec.drain_requested is False
    beat = {"worker_id": rec.id, "token": rec.token, "state": "ready", "in_flight": 0, "ttl": 10}
    assert (await store.worker_heartbeat(**beat)).drain_requested is False
    assert await store.worker_drain(worker_id=rec.id) is True
    assert await store.worker_drain(worker_id=rec.id) is True
    hb = await store.worker_heartbeat(**{**beat, "state": "draining", "in_flight": 1})
    assert (hb.drain_requested, hb.state, hb.token) == (True, "draining", rec.token)
    (listed,) = await store.workers_list()
    assert listed.drain_requested is True
    clock.advance(11)  # the membership lapses (a paused process), then re-registers
    again = await store.worker_register(record=_record(), ttl=10)
    assert (again.drain_requested, again.token) == (True, rec.token + 1)
    (listed,) = await store.workers_list()
    assert listed.drain_requested is True
    other = await store.worker_register(record=_record("other"), ttl=10)
    assert other.drain_requested is False


async def test_worker_drain_refuses_an_unknown_or_no_longer_live_worker(
    store: Any, clock: FakeClock
) -> None:
    """worker_drain answers False, and changes nothing, for a worker id never
    registered, one whose membership expired by the store's clock, and one stopped."""
    assert await store.worker_drain(worker_id="nobody") is False
    assert await store.workers_list() == []
    lapsed = await store.worker_register(record=_record("lapsed"), ttl=5)
    clock.advance(6)
    assert await store.worker_drain(worker_id=lapsed.id) is False
    stopped = await store.worker_register(record=_record("stopped"), ttl=60)
    await store.worker_deregister(worker_id=stopped.id, token=stopped.token)
    assert await store.worker_drain(worker_id=stopped.id) is False
    assert [w.drain_requested for w in await store.workers_list()] == [False, False]


async def test_resource_leases_list_shows_holders_tokens_and_when_each_was_taken(
    store: Any, clock: FakeClock
) -> None:
    """resource_leases_list gives every named lease by name with its holder, token,
    expiry and when its token was issued: a renewal keeps that time, a new holder gets
    a new one; a released lease stays listed, expired, with its last holder and token."""
    assert await store.resource_leases_list() == []
    t0 = clock.now()
    b = await store.resource_lease_acquire(resource="b:Z", owner="w1", ttl=5)
    clock.advance(1)
    a = await store.resource_lease_acquire(resource="a:1", owner="w2", ttl=5)
    clock.advance(1)
    assert await store.resource_lease_renew(lease=b, ttl=10) is not None
    listed = await store.resource_leases_list()
    assert [(x.resource, x.owner, x.token) for x in listed] == [
        ("a:1", "w2", a.token),
        ("b:Z", "w1", b.token),
    ]
    assert [x.acquired_at for x in listed] == [pytest.approx(t0 + 1), pytest.approx(t0)]
    assert [x.expires_at for x in listed] == [pytest.approx(t0 + 6), pytest.approx(t0 + 12)]
    clock.advance(5)
    taken = await store.resource_lease_acquire(resource="a:1", owner="w3", ttl=5)
    assert taken is not None
    assert await store.resource_lease_release(lease=b)
    first, second = await store.resource_leases_list()
    assert (first.owner, first.token, first.acquired_at) == (
        "w3",
        a.token + 1,
        pytest.approx(clock.now()),
    )
    assert (second.owner, second.token) == ("w1", b.token)
    assert second.expires_at <= clock.now()


async def test_finish_and_claim_fences_each_finish_and_claims_the_next_jobs(
    store: Any, clock: FakeClock
) -> None:
    """One request finishes a batch (each row fenced by its own token, a stale one
    refused and recorded) and claims the next jobs with fresh tokens and attempts."""
    a, b, c, d = await store.jobs_enqueue(jobs=[new(), new(), new(), new()])
    first = await store.jobs_claim(owner="w1", queues=Q, limit=2, ttl=5)
    assert [x.job.id for x in first] == [a, b]
    stale = Lease(b, "w1", first[1].lease.token + 7, first[1].lease.expires_at)
    done, claimed = await store.jobs_finish_and_claim(
        finishes=[Finish(first[0].lease, Outcome.SUCCEEDED), Finish(stale, Outcome.SUCCEEDED)],
        owner="w1",
        queues=Q,
        limit=2,
        ttl=5,
    )
    assert done == [True, False]
    assert [x.job.id for x in claimed] == [c, d]
    assert all(x.job.state is JobState.RUNNING and x.job.attempt == 1 for x in claimed)
    assert all(x.lease.owner == "w1" and x.lease.token >= 1 for x in claimed)
    assert (await store.job_get(job_id=a)).state is JobState.SUCCEEDED
    assert (await store.job_get(job_id=b)).state is JobState.RUNNING
    total, recent = await store.stale_commits()
    assert (total, recent[0].job_id, recent[0].token) == (1, b, stale.token)
    for x in claimed:
        (attempt,) = await store.job_attempts(job_id=x.job.id)
        assert (attempt.token, attempt.owner) == (x.lease.token, "w1")
    # The claimed jobs are held like any claim: their holder finishes them, nobody else.
    done, none = await store.jobs_finish_and_claim(
        finishes=[Finish(x.lease, Outcome.SUCCEEDED) for x in claimed],
        owner="w1",
        queues=Q,
        limit=5,
        ttl=5,
    )
    assert (done, none) == ([True, True], [])


async def test_finish_and_claim_with_no_room_claims_nothing(store: Any) -> None:
    """limit 0: the batch is finished and no job is taken."""
    (_, b) = await store.jobs_enqueue(jobs=[new(), new()])
    (first,) = await store.jobs_claim(owner="w1", queues=Q, limit=1, ttl=5)
    done, claimed = await store.jobs_finish_and_claim(
        finishes=[Finish(first.lease, Outcome.SUCCEEDED)], owner="w1", queues=Q, limit=0, ttl=5
    )
    assert (done, claimed) == ([True], [])
    assert (await store.job_get(job_id=b)).state is JobState.QUEUED


async def test_a_job_retried_at_once_is_claimed_again_with_a_new_token(
    store: Any, clock: FakeClock
) -> None:
    """A retry without delay makes the job ready again: the claim in the same request
    may take it back (or, where one statement sees one snapshot, the next claim does),
    either way as a new attempt with a higher token; the old token is dead."""
    (a,) = await store.jobs_enqueue(jobs=[new(max_attempts=3)])
    (first,) = await store.jobs_claim(owner="w1", queues=Q, limit=1, ttl=5)
    done, claimed = await store.jobs_finish_and_claim(
        finishes=[Finish(first.lease, Outcome.RETRY, 0.0, "boom", "transient")],
        owner="w1",
        queues=Q,
        limit=1,
        ttl=5,
    )
    assert done == [True]
    if not claimed:
        claimed = await store.jobs_claim(owner="w1", queues=Q, limit=1, ttl=5)
    (again,) = claimed
    assert again.job.id == a
    assert again.lease.token > first.lease.token
    assert again.job.attempt == 2
    assert await store.jobs_finish(finishes=[Finish(first.lease, Outcome.SUCCEEDED)]) == [False]


async def test_blocking_enqueue_from_a_thread_is_the_same_enqueue(
    store: Any, clock: FakeClock
) -> None:
    """A store that enqueues for synchronous callers on their own thread gives the same
    ids, states and unique-key answers as ``jobs_enqueue``; one that cannot says so."""
    if not store.capabilities.blocking_enqueue:
        with pytest.raises(NotSupportedError):
            store.jobs_enqueue_blocking(jobs=[new()])
        return
    (a,) = await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[new()])
    b, c = await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[new(), new(delay=60)])
    assert a < b < c
    assert (await store.job_get(job_id=a)).state is JobState.QUEUED
    later = await store.job_get(job_id=c)
    assert later.state is JobState.SCHEDULED
    assert later.run_at == pytest.approx(clock.now() + 60)
    keyed = new(idempotency_key="k1", unique=Unique.ALWAYS)
    (first,) = await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[keyed])
    (again,) = await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[keyed])
    assert first == again
    assert await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[]) == []
    claimed = await store.jobs_claim(owner="w", queues=Q, limit=10, ttl=5)
    assert sorted(x.job.id for x in claimed) == [a, b, first]


async def test_a_large_batch_keeps_order_times_and_states(store: Any, clock: FakeClock) -> None:
    """A batch far larger than one job (copied in, where the store can) still returns
    its ids in input order, runs each job by its own delay or run_at from the store's
    clock, and can be claimed in that order."""
    n = 300
    jobs = [new(delay=30.0) if i % 3 == 0 else new(priority=i % 2) for i in range(n)]
    ids = await store.jobs_enqueue(jobs=jobs)
    assert len(set(ids)) == n
    assert ids == sorted(ids)
    scheduled = await store.job_get(job_id=ids[0])
    assert scheduled.state is JobState.SCHEDULED
    assert scheduled.run_at == pytest.approx(clock.now() + 30)
    assert (await store.job_get(job_id=ids[1])).state is JobState.QUEUED
    claimed = await store.jobs_claim(owner="w", queues=Q, limit=n, ttl=5)
    ready = [i for n_, i in enumerate(ids) if n_ % 3 != 0]
    assert sorted(c.job.id for c in claimed) == ready
    # Priority 1 first, each priority in id order.
    expected = [i for n_, i in enumerate(ids) if n_ % 3 and n_ % 2] + [
        i for n_, i in enumerate(ids) if n_ % 3 and not n_ % 2
    ]
    assert [c.job.id for c in claimed] == expected
