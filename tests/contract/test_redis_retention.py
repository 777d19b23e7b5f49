"""The Redis store's retention: the index that finds prunable jobs, the fill of jobs
that ended before it, and the keys a pruned job leaves behind (none)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline._jobs import Finish, NewJob, Outcome, Unique
from tokenline.stores.base import Drift, Inconsistency, PruneKind, ResourceLease
from tokenline.stores.redis import RedisStore

Q = ["default"]


@pytest.fixture
async def rstore(redis_url: str, clock: FakeClock) -> AsyncIterator[RedisStore]:
    s = RedisStore(redis_url, clock=clock)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def client(redis_server: str) -> Any:
    import redis

    with redis.Redis.from_url(redis_server, decode_responses=True) as c:
        yield c


async def leader(store: RedisStore) -> ResourceLease:
    lease = await store.resource_lease_acquire(
        resource="tokenline:maintenance", owner="leader", ttl=10_000
    )
    assert lease is not None
    return lease


async def finish(store: RedisStore, outcome: Outcome, **kw: Any) -> int:
    (jid,) = await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]", **kw)])
    (claimed,) = await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=10)
    (ok,) = await store.jobs_finish(finishes=[Finish(claimed.lease, outcome, None, "e", "x")])
    assert ok
    return jid


def keys_naming(client: Any, store: RedisStore, job_id: int) -> list[str]:
    """Every key, hash field and set member of the store that still names the job."""
    found = []
    for key in client.scan_iter(match=store.prefix + "*"):
        kind = client.type(key)
        if key.endswith((f":{job_id}", f":{job_id:015d}")):
            found.append(key)
        elif kind == "zset" and (
            client.zscore(key, str(job_id)) is not None
            or client.zscore(key, f"{job_id:015d}") is not None
        ):
            found.append(f"{key} (member)")
        elif kind == "hash" and client.hget(key, "job") == str(job_id):
            found.append(f"{key} (holder)")
    return found


async def test_a_pruned_job_leaves_nothing_behind(
    rstore: RedisStore, clock: FakeClock, client: Any
) -> None:
    """A pruned job's hash, attempts, state and id indexes, retention index entry, count
    and released unique key are all gone; the unpruned job keeps all of its own."""
    jid = await finish(rstore, Outcome.SUCCEEDED, idempotency_key="k", unique=Unique.ACTIVE)
    clock.advance(1)
    kept = await finish(rstore, Outcome.SUCCEEDED)
    assert keys_naming(client, rstore, jid)
    clock.advance(100)
    lead = await leader(rstore)
    before = (await rstore.job_get(job_id=kept)).finished_at
    assert before is not None
    n = await rstore.maintenance_prune(
        leader=lead, kind=PruneKind.FINISHED, before=before, limit=10
    )
    assert n == 1
    assert keys_naming(client, rstore, jid) == []
    assert client.hget(rstore.prefix + "counts:default", "succeeded") == "1"
    (stats,) = await rstore.queues_stats()
    assert stats.counts == {"succeeded": 1}
    assert f"{rstore.prefix}job:{kept}" in keys_naming(client, rstore, kept)


async def test_every_way_into_a_final_state_indexes_the_job(
    rstore: RedisStore, clock: FakeClock
) -> None:
    """A rescue that dead-letters and the reconciler's acknowledgement index the job as
    a finish and a cancel do: each is pruned by its own kind."""
    (jid,) = await rstore.jobs_enqueue(
        jobs=[NewJob(queue="default", task="t", args="[]", max_lease_expiries=1)]
    )
    await rstore.jobs_claim(owner="w", queues=Q, limit=1, ttl=1)
    clock.advance(2)
    assert (await rstore.jobs_rescue()).dead == [jid]
    (acked,) = await rstore.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (claimed,) = await rstore.jobs_claim(owner="w", queues=Q, limit=1, ttl=1)
    clock.advance(2)
    lead = await leader(rstore)
    seen = Inconsistency(Drift.JOB_UNACKNOWLEDGED, acked, claimed.lease.token, state="running")
    assert await rstore.reconcile_apply(leader=lead, found=[seen]) == [True]
    clock.advance(10)
    before = await rstore.store_time()
    assert await rstore.maintenance_prunable(kind=PruneKind.DEAD, before=before) == 1
    assert await rstore.maintenance_prunable(kind=PruneKind.FINISHED, before=before) == 1
    assert await rstore.jobs_prune(leader=lead, kind=PruneKind.DEAD, before=before, limit=5) == [
        jid
    ]
    assert await rstore.jobs_prune(
        leader=lead, kind=PruneKind.FINISHED, before=before, limit=5
    ) == [acked]


async def test_jobs_that_ended_before_the_index_are_filled_in(
    rstore: RedisStore, clock: FakeClock, client: Any, redis_url: str
) -> None:
    """Jobs a store held in final states before the index existed are indexed in
    batches by the first prune, then pruned like the others; the fill is done once."""
    done = [await finish(rstore, Outcome.SUCCEEDED) for _ in range(3)]
    dead = await finish(rstore, Outcome.DEAD)
    (cancelled,) = await rstore.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    await rstore.jobs_cancel(job_ids=[cancelled], reason="no")
    # What an earlier release left: final states without the index.
    client.delete(rstore.prefix + "ended:finished", rstore.prefix + "ended:dead")
    clock.advance(100)
    lead = await leader(rstore)
    before = await rstore.store_time()
    fresh = RedisStore(redis_url, clock=clock)
    await fresh.open()
    try:
        # A batch of 2: the fill takes three scripts before the first prune.
        got = await fresh.jobs_prune(leader=lead, kind=PruneKind.FINISHED, before=before, limit=2)
        assert client.hget(rstore.prefix + "ended_fill", "done") == "1"
        got += await fresh.jobs_prune(leader=lead, kind=PruneKind.FINISHED, before=before, limit=2)
        assert sorted(got) == sorted([*done, cancelled])
        assert await fresh.jobs_prune(leader=lead, kind=PruneKind.DEAD, before=before, limit=2) == [
            dead
        ]
    finally:
        await fresh.close()


async def test_prunable_jobs_are_found_through_the_index_alone(
    rstore: RedisStore, clock: FakeClock, client: Any
) -> None:
    """Control: once the fill is done, a finished job missing from the index is never
    found: the prune reads the index, not every job."""
    jid = await finish(rstore, Outcome.SUCCEEDED)
    clock.advance(100)
    lead = await leader(rstore)
    before = await rstore.store_time()
    # The first prune fills the index (nothing older than 0 to take).
    assert (
        await rstore.maintenance_prune(leader=lead, kind=PruneKind.FINISHED, before=0.0, limit=5)
        == 0
    )
    client.zrem(rstore.prefix + "ended:finished", str(jid))
    assert await rstore.maintenance_prunable(kind=PruneKind.FINISHED, before=before) == 0
    assert (
        await rstore.maintenance_prune(leader=lead, kind=PruneKind.FINISHED, before=before, limit=5)
        == 0
    )
    assert (await rstore.job_get(job_id=jid)).id == jid


async def test_refused_lease_renewals_are_pruned_as_duplicates(
    rstore: RedisStore, clock: FakeClock
) -> None:
    """Redis's record of refused renewals of named leases (reported as duplicates by
    the split rstore) goes past the audit retention, not before."""
    old = await rstore.resource_lease_acquire(resource="r", owner="a", ttl=1)
    assert old is not None
    clock.advance(2)
    assert await rstore.resource_lease_acquire(resource="r", owner="b", ttl=100) is not None
    assert await rstore.resource_lease_renew(lease=old, ttl=1) is None
    assert len(await rstore.resource_renewals_refused(limit=10)) == 1
    lead = await leader(rstore)
    kind = PruneKind.DUPLICATES
    past = await rstore.store_time() - 1
    assert await rstore.maintenance_prune(leader=lead, kind=kind, before=past, limit=5) == 0
    clock.advance(10)
    before = await rstore.store_time()
    assert await rstore.maintenance_prunable(kind=kind, before=before) == 1
    assert await rstore.maintenance_prune(leader=lead, kind=kind, before=before, limit=5) == 1
    assert await rstore.resource_renewals_refused(limit=10) == []


async def test_a_job_still_active_is_never_pruned_whatever_the_index_says(
    rstore: RedisStore, clock: FakeClock, client: Any
) -> None:
    """The prune checks each job's own state and finished_at again: a running or
    queued job put into the index by mistake is dropped from it, not deleted."""
    (running, queued) = await rstore.jobs_enqueue(
        jobs=[NewJob(queue="default", task="t", args="[]") for _ in range(2)]
    )
    await rstore.jobs_claim(owner="w", queues=Q, limit=1, ttl=10_000)
    for jid in (running, queued):
        client.zadd(rstore.prefix + "ended:finished", {str(jid): 1.0})
    clock.advance(100)
    lead = await leader(rstore)
    before = await rstore.store_time()
    assert (
        await rstore.jobs_prune(leader=lead, kind=PruneKind.FINISHED, before=before, limit=5) == []
    )
    assert client.zcard(rstore.prefix + "ended:finished") == 0
    assert {j.state.value for j in await rstore.jobs_list()} == {"running", "queued"}
