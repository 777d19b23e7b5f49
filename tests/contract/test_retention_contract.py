"""The retention contract: pruning batches and periodic schedules, on every store.

Every write here is fenced by the maintenance leader's lease, checked by the store in
the same transaction as the write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline._errors import JobNotFoundError, StaleTokenError
from tokenline._jobs import Finish, JobState, Lease, NewJob, Outcome, Unique
from tokenline.stores.base import PruneKind, ResourceLease

#: Pruning and the schedules' marks run on every store; the ledger's audit (marked
#: ``ledger``) where a ledger is played.
LEDGER = pytest.mark.ledger

Q = ["default"]
MAINT = "tokenline:maintenance"


def new(task: str = "t", **kw: Any) -> NewJob:
    return NewJob(queue="default", task=task, args="[]", **kw)


async def leader(store: Any, owner: str = "leader-a", ttl: float = 30.0) -> ResourceLease:
    lease = await store.resource_lease_acquire(resource=MAINT, owner=owner, ttl=ttl)
    assert lease is not None
    return lease


async def finish(store: Any, outcome: Outcome, **kw: Any) -> int:
    """Enqueue one job, claim it and finish it with ``outcome``; its id."""
    (jid,) = await store.jobs_enqueue(jobs=[new(**kw)])
    (claimed,) = await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=10)
    assert claimed.job.id == jid
    (ok,) = await store.jobs_finish(finishes=[Finish(claimed.lease, outcome, None, "e", "x")])
    assert ok
    return jid


async def gone(store: Any, job_id: int) -> bool:
    try:
        await store.job_get(job_id=job_id)
    except JobNotFoundError:
        return True
    return False


async def test_prune_takes_only_finished_jobs_past_their_retention(
    store: Any, clock: FakeClock
) -> None:
    """Old succeeded and cancelled jobs go with their attempts; dead ones only with
    their own kind; queued, scheduled, running and recent jobs are never touched."""
    ok = await finish(store, Outcome.SUCCEEDED)
    dead = await finish(store, Outcome.DEAD)
    (cancelled, waiting, later) = await store.jobs_enqueue(jobs=[new(), new(), new(delay=10_000)])
    assert await store.jobs_cancel(job_ids=[cancelled], reason="no") == 1
    (running,) = await store.jobs_enqueue(jobs=[new()])
    claimed = await store.jobs_claim(owner="w", queues=Q, limit=5, ttl=10_000)
    assert {c.job.id for c in claimed} == {waiting, running}
    clock.advance(1000)
    recent = await finish(store, Outcome.SUCCEEDED)
    lead = await leader(store)
    now = await store.store_time()

    assert await store.maintenance_prunable(kind=PruneKind.FINISHED, before=now - 500) == 2
    n = await store.maintenance_prune(
        leader=lead, kind=PruneKind.FINISHED, before=now - 500, limit=100
    )
    assert n == 2
    assert await gone(store, ok)
    assert await gone(store, cancelled)
    with pytest.raises(JobNotFoundError):
        await store.job_attempts(job_id=ok)
    for kept in (dead, waiting, later, running, recent):
        assert not await gone(store, kept)
    assert (await store.job_get(job_id=waiting)).state is JobState.RUNNING

    n = await store.maintenance_prune(leader=lead, kind=PruneKind.DEAD, before=now - 500, limit=9)
    assert n == 1
    assert await gone(store, dead)
    assert await store.maintenance_prunable(kind=PruneKind.FINISHED, before=now - 500) == 0


async def test_prune_goes_in_batches_of_at_most_limit(store: Any, clock: FakeClock) -> None:
    """Each call deletes at most ``limit`` rows; the last batch comes back short."""
    for _ in range(5):
        await finish(store, Outcome.SUCCEEDED)
    clock.advance(100)
    lead = await leader(store)
    before = await store.store_time()
    got = [
        await store.maintenance_prune(leader=lead, kind=PruneKind.FINISHED, before=before, limit=2)
        for _ in range(4)
    ]
    assert got == [2, 2, 1, 0]


async def test_prune_frees_released_unique_keys_and_keeps_held_ones(
    store: Any, clock: FakeClock
) -> None:
    """A pruned job's released key can be taken again; a key held for good still
    returns its holder after the prune."""
    active = await finish(store, Outcome.SUCCEEDED, idempotency_key="a", unique=Unique.ACTIVE)
    always = await finish(store, Outcome.SUCCEEDED, idempotency_key="b", unique=Unique.ALWAYS)
    clock.advance(100)
    lead = await leader(store)
    before = await store.store_time()
    assert (
        await store.maintenance_prune(leader=lead, kind=PruneKind.FINISHED, before=before, limit=10)
        == 2
    )
    (again,) = await store.jobs_enqueue(jobs=[new(idempotency_key="a", unique=Unique.ACTIVE)])
    assert again != active
    assert not await gone(store, again)
    (held,) = await store.jobs_enqueue(jobs=[new(idempotency_key="b", unique=Unique.ALWAYS)])
    assert held == always


async def test_prune_spares_a_dead_job_retried_since(store: Any, clock: FakeClock) -> None:
    """A dead job an operator retried is queued again: it leaves the dead jobs' retention
    and no prune of any kind takes it, however long ago it first died."""
    jid = await finish(store, Outcome.DEAD)
    assert await store.jobs_retry_dead(job_ids=[jid]) == 1
    clock.advance(100)
    lead = await leader(store)
    before = await store.store_time()
    for kind in (PruneKind.DEAD, PruneKind.FINISHED):
        assert await store.maintenance_prunable(kind=kind, before=before) == 0
        assert await store.maintenance_prune(leader=lead, kind=kind, before=before, limit=9) == 0
    assert (await store.job_get(job_id=jid)).state is JobState.QUEUED


async def test_prune_removes_old_stale_commits_only(store: Any, clock: FakeClock) -> None:
    """A refused stale write is kept until its retention is over, then pruned, and the
    total the store reports goes down with it."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    (claimed,) = await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=10)
    forged = Lease(jid, "w", claimed.lease.token + 1, claimed.lease.expires_at)
    assert await store.jobs_finish(finishes=[Finish(forged, Outcome.SUCCEEDED)]) == [False]
    assert (await store.stale_commits())[0] == 1
    lead = await leader(store)
    kind = PruneKind.STALE_COMMITS
    past = await store.store_time() - 1
    assert await store.maintenance_prune(leader=lead, kind=kind, before=past, limit=10) == 0
    clock.advance(10)
    before = await store.store_time()
    assert await store.maintenance_prunable(kind=kind, before=before) == 1
    assert await store.maintenance_prune(leader=lead, kind=kind, before=before, limit=10) == 1
    assert await store.stale_commits() == (0, [])


@LEDGER
async def test_prune_removes_old_audit_rows_only(store: Any, clock: FakeClock) -> None:
    """Refused stale commits and duplicates go past their retention, not before."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    (claimed,) = await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=10)
    forged = Lease(jid, "w", claimed.lease.token + 1, claimed.lease.expires_at)
    assert await store.jobs_finish(finishes=[Finish(forged, Outcome.SUCCEEDED)]) == [False]
    await store.effect_begin(lease=forged, key="k")
    assert len(await store.duplicates_list()) == 2  # the ledger's and the refused commit
    lead = await leader(store)
    past = await store.store_time() - 1
    for kind in (PruneKind.STALE_COMMITS, PruneKind.DUPLICATES):
        assert await store.maintenance_prune(leader=lead, kind=kind, before=past, limit=10) == 0
    clock.advance(10)
    before = await store.store_time()
    for kind in (PruneKind.STALE_COMMITS, PruneKind.DUPLICATES):
        assert await store.maintenance_prunable(kind=kind, before=before) == 1
        assert await store.maintenance_prune(leader=lead, kind=kind, before=before, limit=10) == 1
    assert (await store.stale_commits())[0] == 0
    assert await store.duplicates_list() == []


async def test_a_deposed_or_expired_leader_prunes_nothing(store: Any, clock: FakeClock) -> None:
    """The store checks the leader's lease in the prune's own transaction."""
    jid = await finish(store, Outcome.SUCCEEDED)
    old = await leader(store, "leader-a", ttl=5)
    clock.advance(6)
    before = await store.store_time()
    with pytest.raises(StaleTokenError):
        await store.maintenance_prune(leader=old, kind=PruneKind.FINISHED, before=before, limit=9)
    await leader(store, "leader-b", ttl=5)
    with pytest.raises(StaleTokenError):
        await store.maintenance_prune(leader=old, kind=PruneKind.FINISHED, before=before, limit=9)
    assert not await gone(store, jid)


async def test_schedule_mark_moves_forwards_only_with_its_job(store: Any) -> None:
    """An instant at or before the mark enqueues nothing; a later one moves the mark
    and enqueues its job in the same transaction."""
    lead = await leader(store)
    job = new("tick", idempotency_key="periodic:tick:100", unique=Unique.ACTIVE)
    assert await store.schedule_advance(leader=lead, schedule="tick", instant=100.0, job=job)
    assert not await store.schedule_advance(leader=lead, schedule="tick", instant=100.0, job=job)
    assert not await store.schedule_advance(leader=lead, schedule="tick", instant=50.0, job=job)
    assert await store.schedule_advance(leader=lead, schedule="tick", instant=160.0, job=None)
    assert await store.schedule_marks() == {"tick": 160.0}
    jobs = await store.jobs_list()
    assert [j.idempotency_key for j in jobs] == ["periodic:tick:100"]


async def test_a_deposed_leader_cannot_advance_a_schedule(store: Any, clock: FakeClock) -> None:
    """The schedule's write is fenced by the leader's lease like every maintenance write."""
    old = await leader(store, "leader-a", ttl=5)
    clock.advance(6)
    await leader(store, "leader-b", ttl=5)
    with pytest.raises(StaleTokenError):
        await store.schedule_advance(leader=old, schedule="tick", instant=1.0, job=new())
    assert await store.schedule_marks() == {}
    assert await store.jobs_list() == []


async def instant_runs(store: Any, mark_checked: bool) -> int:
    """Leader A enqueues an instant, the job runs and finishes (its unique key is
    released), then leader B — which does not know — submits the same instant."""
    clock_store = store
    a = await leader(clock_store, "leader-a", ttl=5)
    job = new("tick", idempotency_key="periodic:tick:60", unique=Unique.ACTIVE)
    assert await store.schedule_advance(leader=a, schedule="tick", instant=60.0, job=job)
    (claimed,) = await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=10)
    await store.job_complete(lease=claimed.lease)
    assert await store.resource_lease_release(lease=a)
    b = await leader(store, "leader-b", ttl=5)
    advanced = await store.schedule_advance(leader=b, schedule="tick", instant=60.0, job=job)
    assert advanced is not mark_checked
    return len(await store.jobs_list())


async def test_an_instant_that_ran_is_never_enqueued_again(store: Any) -> None:
    """The high-water mark, not the (released) unique key, keeps a finished instant
    from running twice across a leader change."""
    assert await instant_runs(store, mark_checked=True) == 1


@pytest.fixture(params=["memory", "sqlite", "postgres", "redis"])
async def markless(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Any:
    import sabotage

    if request.param == "memory":
        s = sabotage.MarklessMemoryStore(clock=clock)
    elif request.param == "sqlite":
        s = sabotage.MarklessSQLiteStore(f"sqlite:///{tmp_path / 'm.db'}", clock=clock)
    elif request.param == "postgres":
        s = sabotage.markless_postgres(request.getfixturevalue("postgres_url"), clock=clock)
    else:
        s = sabotage.markless_redis(request.getfixturevalue("redis_url"), clock=clock)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def test_control_without_the_mark_the_instant_runs_twice(markless: Any) -> None:
    """Control experiment: with the mark check taken out (tests/sabotage.py), the same
    sequence enqueues the finished instant a second time."""
    assert await instant_runs(markless, mark_checked=False) == 2
