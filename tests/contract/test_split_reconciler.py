"""The reconciler on the split topology: each disagreement between Redis and the
ledger is made directly in the stores, found, repaired (or flagged) once and counted,
a dry run repairs nothing, and a deposed leader's repair is refused on both sides."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline._errors import StaleTokenError
from tokenline._jobs import Finish, JobState, Lease, NewJob, Outcome, WorkerRecord
from tokenline._records import EffectStatus, Start
from tokenline.maintenance import MAINTENANCE_LEASE, Leadership, Reconciler
from tokenline.stores.base import Drift, ResourceLease
from tokenline.stores.split import SplitStore

TTL = 10.0
DEADLINE = 60.0
Q = ["default"]


def new(run_at: float | None = None) -> NewJob:
    return NewJob(queue="default", task="t", args="[]", run_at=run_at)


async def leader_of(store: SplitStore, clock: FakeClock, owner: str = "leader") -> ResourceLease:
    lease = await Leadership(store, owner=owner, ttl=TTL, margin=1.0, clock=clock).elect()
    assert lease is not None
    return lease


async def committed(store: SplitStore, lease: Lease) -> None:
    """The job's fenced transaction commits in the ledger; Redis never hears of it."""
    async with store.ledger.fenced_transaction(lease=lease) as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS biz (job bigint)")
        await conn.execute("INSERT INTO biz VALUES (%s)", (lease.job_id,))


async def reconcile(store: SplitStore, clock: FakeClock) -> Any:
    """A dry run, a pass and a second pass: the dry run sees what the pass repairs, the
    second pass finds nothing left."""
    leader = await leader_of(store, clock)
    service = Reconciler(store, interval=1, pending_deadline=DEADLINE)
    dry = await service.run_once(leader=None, dry_run=True)
    report = await service.run_once(leader=leader)
    assert not report.refused
    assert dry.counts == report.counts
    again = await service.run_once(leader=leader)
    assert again.total == 0, again.lines
    return report


async def test_a_job_the_ledger_completed_is_acknowledged_in_redis(
    split: SplitStore, clock: FakeClock
) -> None:
    """Jobs whose fenced transaction committed in the ledger while Redis still holds
    them running on an expired lease, queued, or scheduled are acknowledged (counted,
    each once); a dry run changes nothing; a job with a live lease is left to its owner,
    and one the ledger has not completed is left alone."""
    await split.jobs_enqueue(jobs=[new(), new(), new(), new(), new()])
    claims = await split.jobs_claim(owner="w1", queues=Q, limit=5, ttl=5)
    running, queued, scheduled, live, undone = claims
    for claimed in (running, queued, scheduled, live):
        await committed(split, claimed.lease)
    # Their acknowledgements were lost; the leases of all but one lapse, and two jobs
    # go back to Redis's queue (a retry, a delay) as a worker that lost the ack might.
    await split.jobs_finish(
        finishes=[
            Finish(queued.lease, Outcome.RELEASE, 0.0, "lost ack", "coordination"),
            Finish(scheduled.lease, Outcome.RELEASE, 3600.0, "lost ack", "coordination"),
        ]
    )
    assert (await split.job_leases_renew(owner="w1", leases=[live.lease], ttl=1000))[0]
    clock.advance(6)
    found = await split.reconcile_find(pending_deadline=DEADLINE)
    seen = {(f.job_id, f.state) for f in found if f.kind is Drift.JOB_UNACKNOWLEDGED}
    assert seen == {
        (running.job.id, "running"),
        (queued.job.id, "queued"),
        (scheduled.job.id, "scheduled"),
    }

    dry = await Reconciler(split, interval=1, pending_deadline=DEADLINE).run_once(
        leader=None, dry_run=True
    )
    assert dry.counts == {Drift.JOB_UNACKNOWLEDGED.value: 3}
    assert (await split.job_get(job_id=queued.job.id)).state is JobState.QUEUED

    report = await reconcile(split, clock)
    assert report.counts == {Drift.JOB_UNACKNOWLEDGED.value: 3}
    for claimed in (running, queued, scheduled):
        job = await split.job_get(job_id=claimed.job.id)
        assert (job.state, job.lease_owner) == (JobState.SUCCEEDED, None), claimed.job.id
    assert (await split.job_get(job_id=live.job.id)).state is JobState.RUNNING
    assert (await split.job_get(job_id=undone.job.id)).state is JobState.RUNNING
    # The attempt that ran is closed as acknowledged, not as a success of its own.
    (attempt,) = await split.job_attempts(job_id=running.job.id)
    assert attempt.outcome == "acknowledged"
    # The queued one was taken with a new token first: the lost holder matches nothing.
    assert (await split.job_get(job_id=queued.job.id)).lease_token == queued.lease.token + 1
    assert await split.jobs_claim(owner="w2", queues=Q, limit=5, ttl=5) == []


async def test_an_abandoned_pending_effect_is_failed_and_its_attempt_fenced_out(
    split: SplitStore, clock: FakeClock
) -> None:
    """An effect pending past the deadline whose lease Redis has let go is marked
    failed in the ledger, and the ledger refuses that attempt from then on, even if a
    Redis that lost the rescue still said it held the job."""
    await split.jobs_enqueue(jobs=[new()])
    (claimed,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=5)
    assert (await split.effect_begin(lease=claimed.lease, key="charge:1")).start is Start.RUN
    clock.advance(DEADLINE + 6)
    report = await reconcile(split, clock)
    assert report.counts == {Drift.EFFECT_PENDING.value: 1}
    (effect,) = await split.effects_list(key="charge:1")
    assert effect.status is EffectStatus.FAILED
    # The ledger itself now refuses the lost attempt's writes.
    assert (await split.ledger.effect_begin(lease=claimed.lease, key="other")).start is Start.STALE
    assert not await split.effect_finish(lease=claimed.lease, key="charge:1", result="1")


async def _drop_from_redis(store: SplitStore, job_id: int) -> None:
    """Redis forgets a job entirely, as a failover to a replica that missed it would."""
    job = await store.job_get(job_id=job_id)
    p = store.redis.prefix
    pad = f"{job_id:015d}"
    await store.redis._cmd("DEL", f"{p}job:{job_id}", f"{p}attempts:{job_id}")
    await store.redis._cmd("ZREM", f"{p}all", job_id)
    await store.redis._cmd("ZREM", f"{p}st:{job.state.value}", job_id)
    await store.redis._cmd("ZREM", f"{p}running", pad)
    await store.redis._cmd("HINCRBY", f"{p}counts:default", job.state.value, -1)


async def test_a_job_the_ledger_saw_and_redis_lost_is_flagged_once(
    split: SplitStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A job that wrote to the ledger and is gone from Redis cannot be repaired: it is
    reported with the reason and counted, flagged once (the next pass is clean), and
    the ledger refuses its attempt from then on. A completed job gone from Redis (as
    pruned) is no disagreement."""
    await split.jobs_enqueue(jobs=[new(), new()])
    lost, finished = await split.jobs_claim(owner="w1", queues=Q, limit=2, ttl=60)
    assert (await split.effect_begin(lease=lost.lease, key="ship:1")).start is Start.RUN
    await committed(split, finished.lease)
    await _drop_from_redis(split, lost.job.id)
    await _drop_from_redis(split, finished.job.id)
    report = await reconcile(split, clock)
    assert report.counts == {Drift.JOB_LOST.value: 1}
    (line,) = report.lines
    assert line.startswith(f"flagged job_lost_from_broker: job {lost.job.id} ")
    assert "cannot be repaired" in line
    assert "cannot be repaired" in caplog.text
    begun = await split.ledger.effect_begin(lease=lost.lease, key="ship:2")
    assert begun.start is Start.STALE


async def test_an_orphaned_lease_and_an_open_attempt_in_redis_are_repaired(
    split: SplitStore, clock: FakeClock
) -> None:
    """Redis's own drift: a named lease held by a stopped worker gets its token bumped;
    an attempt left open behind the store's back, its job moved on, is closed as lost;
    the running attempt of a live job is left alone."""
    rec = WorkerRecord("w-gone", "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)
    rec = await split.worker_register(record=rec, ttl=TTL)
    held = await split.resource_lease_acquire(resource="acct:1", owner="w-gone", ttl=1000)
    assert held is not None
    await split.worker_deregister(worker_id="w-gone", token=rec.token)
    await split.jobs_enqueue(jobs=[new()])
    (claimed,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=1000)
    ghost = {"attempt": "1", "token": "0", "counter": "0", "owner": "lost-worker",
             "started_at": "0", "finished_at": None, "outcome": None, "error": None,
             "error_class": None}  # fmt: skip
    await split.redis._cmd(
        "LPUSH", f"{split.redis.prefix}attempts:{claimed.job.id}", json.dumps(ghost)
    )
    report = await reconcile(split, clock)
    assert report.counts == {Drift.LEASE_ORPHANED.value: 1, Drift.ATTEMPT_OPEN.value: 1}
    leases = {lease.resource: lease for lease in await split.resource_leases_list()}
    assert leases["acct:1"].token == held.token + 1
    assert await split.resource_lease_renew(lease=held, ttl=10) is None
    outcomes = {a.token: a.outcome for a in await split.job_attempts(job_id=claimed.job.id)}
    assert outcomes == {0: "lost", claimed.lease.token: None}


async def test_a_repair_of_something_that_changed_since_is_not_applied(
    split: SplitStore, clock: FakeClock
) -> None:
    """Between the find and the repair a worker claims the job, and the orphaned lease
    is taken over: both repairs are refused as changed since, and nothing moves."""
    await split.jobs_enqueue(jobs=[new()])
    (first,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=5)
    await committed(split, first.lease)
    rec = WorkerRecord("w-gone", "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)
    rec = await split.worker_register(record=rec, ttl=TTL)
    assert await split.resource_lease_acquire(resource="acct:2", owner="w-gone", ttl=TTL)
    await split.worker_deregister(worker_id="w-gone", token=rec.token)
    clock.advance(6)
    await split.jobs_rescue()
    found = await split.reconcile_find(pending_deadline=DEADLINE)
    assert sorted(f.kind.value for f in found) == ["job_unacknowledged", "lease_orphaned"]
    # Meanwhile the job is claimed straight from Redis, and the lease changes hands.
    (again,) = await split.redis.jobs_claim(owner="w2", queues=Q, limit=1, ttl=1000)
    clock.advance(TTL)
    assert await split.resource_lease_acquire(resource="acct:2", owner="w3", ttl=1000)
    leader = await leader_of(split, clock)
    assert await split.reconcile_repair(leader=leader, found=found) == [False, False]
    job = await split.job_get(job_id=first.job.id)
    assert (job.state, job.lease_token) == (JobState.RUNNING, again.lease.token)


async def _pending_effect(split: SplitStore, clock: FakeClock, key: str) -> None:
    await split.jobs_enqueue(jobs=[new()])
    (claimed,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=5)
    assert (await split.effect_begin(lease=claimed.lease, key=key)).start is Start.RUN
    clock.advance(DEADLINE + 6)


async def test_a_deposed_leaders_repair_is_refused_in_redis_and_in_the_ledger(
    split: SplitStore, clock: FakeClock
) -> None:
    """A repair under a term Redis no longer holds is refused with nothing changed; and
    once a newer term has written to the ledger, an older term is refused there even
    when Redis has lost the maintenance lease and hands the old term out again."""
    await _pending_effect(split, clock, "fx:1")
    old = await leader_of(split, clock, "m-a")
    clock.advance(TTL + 1)
    newer = await leader_of(split, clock, "m-b")
    assert newer.token > old.token
    found = await split.reconcile_find(pending_deadline=DEADLINE)
    with pytest.raises(StaleTokenError):
        await split.reconcile_repair(leader=old, found=found)
    (effect,) = await split.effects_list(key="fx:1")
    assert effect.status is EffectStatus.PENDING
    assert await split.reconcile_repair(leader=newer, found=found) == [True]

    # Redis loses the maintenance lease (its counter with it): m-a wins the old term's
    # number again and Redis vouches for it; the ledger's fence refuses it.
    await _pending_effect(split, clock, "fx:2")
    await split.redis._cmd("DEL", f"{split.redis.prefix}rl:{MAINTENANCE_LEASE}")
    again = await leader_of(split, clock, "m-a")
    assert again.token <= old.token
    found = await split.reconcile_find(pending_deadline=DEADLINE)
    assert [f.key for f in found] == ["fx:2"]
    with pytest.raises(StaleTokenError):
        await split.reconcile_repair(leader=again, found=found)
    (effect,) = await split.effects_list(key="fx:2")
    assert effect.status is EffectStatus.PENDING


def test_tokenline_reconcile_runs_against_a_split_store(redis_url: str, postgres_url: str) -> None:
    """``tokenline reconcile`` on the split topology's URL: the dry run reports the job
    the ledger completed and Redis holds queued, changing nothing (exit 1); the pass
    acknowledges it (exit 1, the counts by kind); the next pass is clean (exit 0)."""
    import asyncio

    from click.testing import CliRunner

    from tokenline.cli import main
    from tokenline.stores import split_url

    url = split_url(redis_url, postgres_url)

    async def seed() -> int:
        store = SplitStore(broker=redis_url, ledger=postgres_url)
        await store.open()
        try:
            await store.jobs_enqueue(jobs=[new()])
            (claimed,) = await store.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
            await committed(store, claimed.lease)
            release = Finish(claimed.lease, Outcome.RELEASE, 0.0, "lost ack", "coordination")
            await store.jobs_finish(finishes=[release])
            return int(claimed.job.id)
        finally:
            await store.close()

    async def state(job_id: int) -> JobState:
        store = SplitStore(broker=redis_url, ledger=postgres_url)
        await store.open()
        try:
            return (await store.job_get(job_id=job_id)).state
        finally:
            await store.close()

    job_id = asyncio.run(seed())
    runner = CliRunner()
    dry = runner.invoke(main, ["reconcile", "--url", url, "--dry-run", "--json"])
    assert dry.exit_code == 1, dry.output
    assert json.loads(dry.stdout)["counts"] == {"job_unacknowledged": 1}
    assert asyncio.run(state(job_id)) is JobState.QUEUED
    done = runner.invoke(main, ["reconcile", "--url", url, "--json"])
    assert done.exit_code == 1, done.output
    out = json.loads(done.stdout)
    assert (out["counts"], out["refused"]) == ({"job_unacknowledged": 1}, False)
    assert asyncio.run(state(job_id)) is JobState.SUCCEEDED
    clean = runner.invoke(main, ["reconcile", "--url", url, "--json"])
    assert clean.exit_code == 0, clean.output


def test_tokenline_reconcile_lists_the_jobs_found_gone_from_redis_earlier(
    redis_url: str, postgres_url: str
) -> None:
    """A worker's reconciler flagged a job the ledger had seen and Redis lost; after
    that, `tokenline reconcile` said "nothing to repair" and `tokenline job` "no job
    with id": the flag was in the worker's log alone. reconcile now lists the job, in
    text and in --json, and still exits 0 (nothing to repair now)."""
    import asyncio

    from click.testing import CliRunner

    from tokenline.cli import main
    from tokenline.stores import split_url

    async def lose_one() -> int:
        store = SplitStore(broker=redis_url, ledger=postgres_url)
        await store.open()
        try:
            await store.jobs_enqueue(jobs=[new()])
            (claimed,) = await store.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
            assert (await store.effect_begin(lease=claimed.lease, key="k")).start is Start.RUN
            await _drop_from_redis(store, claimed.job.id)
            leader = await store.resource_lease_acquire(
                resource=MAINTENANCE_LEASE, owner="a worker", ttl=60
            )
            service = Reconciler(store, interval=1.0, pending_deadline=DEADLINE)
            report = await service.run_once(leader=leader)
            await store.resource_lease_release(lease=leader)
            assert report.counts == {Drift.JOB_LOST.value: 1}  # the worker's pass
            return int(claimed.job.id)
        finally:
            await store.close()

    job_id = asyncio.run(lose_one())
    url = split_url(redis_url, postgres_url)
    runner = CliRunner()
    text = runner.invoke(main, ["reconcile", "--url", url, "--dry-run"])
    assert text.exit_code == 0, text.output
    assert "nothing to repair" in text.output
    assert f"jobs found gone from the broker (job_lost_from_broker): {job_id};" in " ".join(
        text.output.split()
    )
    as_json = runner.invoke(main, ["reconcile", "--url", url, "--dry-run", "--json"])
    assert [j["job_id"] for j in json.loads(as_json.output)["lost_from_broker"]] == [job_id]
