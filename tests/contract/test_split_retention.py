"""Retention on the split topology: what the pruner deletes from Redis, the ledger
hears of, so that the reconciler's lost-job check never takes a pruned job for lost,
and a pruned job's fence keeps refusing its stale attempts."""

from __future__ import annotations

import pytest

from tokenline._clock import FakeClock
from tokenline._errors import StaleTokenError
from tokenline._jobs import ClaimedJob, Finish, NewJob, Outcome
from tokenline._records import Start
from tokenline.stores.base import Drift, PruneKind, ResourceLease
from tokenline.stores.split import SplitStore

Q = ["default"]


async def leader(store: SplitStore) -> ResourceLease:
    lease = await store.resource_lease_acquire(
        resource="tokenline:maintenance", owner="leader", ttl=10_000
    )
    assert lease is not None
    return lease


async def ran(store: SplitStore, outcome: Outcome | None) -> ClaimedJob:
    """A job that took an effect key in the ledger (so the ledger has its fence, not
    done), then finished in Redis with ``outcome`` (``None``: still running)."""
    (jid,) = await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (claimed,) = await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=10_000)
    begun = await store.effect_begin(lease=claimed.lease, key=f"mail:{jid}")
    assert begun.start is Start.RUN
    if outcome is not None:
        finish = Finish(claimed.lease, outcome, None, "e", "x")
        assert await store.jobs_finish(finishes=[finish]) == [True]
    return claimed


async def lost_ids(store: SplitStore) -> set[int | None]:
    found = await store.reconcile_find(pending_deadline=1e9)
    return {item.job_id for item in found if item.kind is Drift.JOB_LOST}


async def drop_from_redis(store: SplitStore, job_id: int) -> None:
    """Redis forgets a running job entirely, as a failover to a replica would."""
    p = store.redis.prefix
    await store.redis._cmd("DEL", f"{p}job:{job_id}", f"{p}attempts:{job_id}")
    for index, member in (("all", job_id), ("st:running", job_id), ("running", f"{job_id:015d}")):
        await store.redis._cmd("ZREM", p + index, member)


async def test_a_pruned_job_is_never_taken_for_lost(split: SplitStore, clock: FakeClock) -> None:
    """Succeeded and dead jobs that wrote to the ledger are pruned from Redis and their
    fences settled: the lost-job check reports only the job Redis really lost."""
    done = await ran(split, Outcome.SUCCEEDED)
    dead = await ran(split, Outcome.DEAD)
    lost = await ran(split, None)
    await drop_from_redis(split, lost.job.id)
    clock.advance(100)
    lead = await leader(split)
    before = await split.store_time()
    for kind in (PruneKind.FINISHED, PruneKind.DEAD):
        assert await split.maintenance_prune(leader=lead, kind=kind, before=before, limit=9) == 1
    assert await split.redis.jobs_existing(job_ids=[done.job.id, dead.job.id]) == set()
    assert await split.redis.pruned_noted(limit=9) == []
    assert await lost_ids(split) == {lost.job.id}


async def test_a_prune_the_ledger_missed_is_settled_by_the_next_batch(
    split: SplitStore, clock: FakeClock
) -> None:
    """A batch deleted from Redis whose ledger write never came (the ledger was down,
    the process died) stays noted in Redis: the check leaves it, and the next batch
    settles it first."""
    done = await ran(split, Outcome.SUCCEEDED)
    clock.advance(100)
    lead = await leader(split)
    before = await split.store_time()
    got = await split.redis.jobs_prune(
        leader=lead, kind=PruneKind.FINISHED, before=before, limit=9, note=True
    )
    assert got == [done.job.id]
    assert await lost_ids(split) == set()
    assert (
        await split.maintenance_prune(leader=lead, kind=PruneKind.FINISHED, before=before, limit=9)
        == 0
    )
    assert await split.redis.pruned_noted(limit=9) == []
    assert await split.ledger.fences_still_unsettled(job_ids=[done.job.id]) == set()
    assert await lost_ids(split) == set()


async def test_control_a_pruned_job_neither_noted_nor_settled_is_reported_lost(
    split: SplitStore, clock: FakeClock
) -> None:
    """Control: with the note dropped before the ledger heard of the prune, the check
    has nothing to tell a pruned job from a lost one, and reports it."""
    done = await ran(split, Outcome.SUCCEEDED)
    clock.advance(100)
    lead = await leader(split)
    before = await split.store_time()
    await split.redis.jobs_prune(
        leader=lead, kind=PruneKind.FINISHED, before=before, limit=9, note=True
    )
    await split.redis.pruned_forget(job_ids=[done.job.id])
    assert await lost_ids(split) == {done.job.id}


async def test_a_pruned_jobs_fence_still_refuses_its_stale_attempt(
    split: SplitStore, clock: FakeClock
) -> None:
    """The ledger keeps a pruned job's fence, settled: an attempt of that job that
    comes back to the ledger (past Redis's early check) is refused. Control: without
    the row, the same write would be let in."""
    done = await ran(split, Outcome.SUCCEEDED)
    clock.advance(100)
    lead = await leader(split)
    before = await split.store_time()
    await split.maintenance_prune(leader=lead, kind=PruneKind.FINISHED, before=before, limit=9)
    begun = await split.ledger.effect_begin(lease=done.lease, key="mail:again")
    assert begun.start is Start.STALE
    schema = split.ledger.schema
    await split.ledger._tuples(
        f"DELETE FROM {schema}.job_fences WHERE job_id = %(j)s RETURNING job_id",
        {"j": done.job.id},
    )
    begun = await split.ledger.effect_begin(lease=done.lease, key="mail:again")
    assert begun.start is Start.RUN


async def test_a_deposed_leaders_ledger_write_is_refused(
    split: SplitStore, clock: FakeClock
) -> None:
    """Once a newer term has written to the ledger, an older term's settle is refused
    there even if Redis were to say it still holds the lease."""
    done = await ran(split, Outcome.SUCCEEDED)
    old = await split.resource_lease_acquire(resource="tokenline:maintenance", owner="a", ttl=5)
    assert old is not None
    clock.advance(6)
    new = await split.resource_lease_acquire(resource="tokenline:maintenance", owner="b", ttl=99)
    assert new is not None
    await split.ledger.fences_pruned(leader=new, job_ids=[])
    with pytest.raises(StaleTokenError):
        await split.ledger.fences_pruned(leader=old, job_ids=[done.job.id])
    assert await split.ledger.fences_still_unsettled(job_ids=[done.job.id]) == {done.job.id}
