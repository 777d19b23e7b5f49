"""Maintenance contract: one leader per term, deposed leaders' writes refused, and each
reconciler check finding and repairing an inconsistency made directly in the store."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from sabotage import LeaderlessMemoryStore, LeaderlessSQLiteStore, leaderless_postgres
from tokenline._clock import FakeClock
from tokenline._errors import StaleTokenError
from tokenline._jobs import Attempt, Finish, JobState, NewJob, Outcome, WorkerRecord
from tokenline._records import EffectStatus, Start
from tokenline.maintenance import MAINTENANCE_LEASE, Leadership, Reconciler, Rescuer
from tokenline.stores import MemoryStore, Store
from tokenline.stores.base import Drift, ResourceLease
from tokenline.stores.sqlite import SQLiteStore

TTL = 10.0
DEADLINE = 60.0
Q = ["default"]


def new(key: str | None = None) -> NewJob:
    return NewJob(queue="default", task="t", args="[]", idempotency_key=key)


def elector(store: Any, owner: str, clock: FakeClock) -> Leadership:
    return Leadership(store, owner=owner, ttl=TTL, margin=1.0, clock=clock)


async def running_job(store: Any, key: str | None = None, ttl: float = 5.0) -> Any:
    await store.jobs_enqueue(jobs=[new(key)])
    (claimed,) = await store.jobs_claim(owner="w1", queues=Q, limit=1, ttl=ttl)
    return claimed


async def requeued_job(store: Any, clock: FakeClock) -> int:
    """A job that ran once, lost its lease and was rescued: queued again."""
    claimed = await running_job(store, ttl=1)
    clock.advance(2)
    assert list((await store.jobs_rescue()).requeued) == [claimed.job.id]
    return int(claimed.job.id)


async def leader_of(store: Any, clock: FakeClock) -> ResourceLease:
    lease = await elector(store, "leader", clock).elect()
    assert lease is not None
    return lease


# -- election and fencing ---------------------------------------------------------------
async def _deposed_rescue(a: Any, b: Any, clock: FakeClock) -> tuple[bool, int, int]:
    """Leader A's term passes while it is paused; B takes a new term; A, resumed, rescues
    with its old term. Returns (A refused, job id, the job's token after)."""
    old, new_ = elector(a, "m-a", clock), elector(b, "m-b", clock)
    first = await old.elect()
    assert first is not None
    assert await new_.elect() is None  # one leader per term
    claimed = await running_job(a)
    clock.advance(TTL + 1)  # A paused past its term; the job's lease expired meanwhile
    second = await new_.elect()
    assert second is not None
    assert second.token > first.token
    assert old.current() is None  # A's own clock says so, too
    try:
        await a.jobs_rescue(leader=first)
        refused = False
    except StaleTokenError as exc:
        refused = (exc.resource, exc.token) == (MAINTENANCE_LEASE, first.token)
    job = await a.job_get(job_id=claimed.job.id)
    return refused, claimed.job.id, job.lease_token


async def test_a_deposed_leaders_rescue_is_refused(
    store_pair: tuple[Any, Any], clock: FakeClock
) -> None:
    """Once a newer term exists, a rescue under the old one is refused and changes
    nothing; the new leader's rescue takes the job."""
    a, b = store_pair
    refused, jid, token = await _deposed_rescue(a, b, clock)
    assert refused
    assert token == 1  # not rescued by the deposed leader
    leader = (await b.resource_leases_list())[0]
    report = await Rescuer(b, interval=1).run_once(leader=leader)
    assert (report.refused, report.counts["requeued"]) == (False, 1)
    assert (await b.job_get(job_id=jid)).state is JobState.QUEUED


def _leaderless(backend: str, clock: FakeClock, tmp_path: Path, request: Any) -> Store:
    if backend == "memory":
        return LeaderlessMemoryStore(clock=clock)
    if backend == "sqlite":
        return LeaderlessSQLiteStore(f"sqlite:///{tmp_path / 'leaderless.db'}", clock=clock)
    return leaderless_postgres(request.getfixturevalue("postgres_url"), clock=clock)


async def test_sabotage_without_the_leader_check_the_deposed_rescue_is_applied(
    store: Any, clock: FakeClock, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The control: with the store's leader check removed, the same deposed leader's
    rescue goes through — the check is what refuses it."""
    backend = request.node.callspec.params["store"]
    sabotaged = _leaderless(backend, clock, tmp_path, request)
    await sabotaged.open()
    try:
        refused, _, token = await _deposed_rescue(sabotaged, sabotaged, clock)
    finally:
        await sabotaged.close()
    assert not refused
    assert token == 2  # the deposed leader's write was applied


async def test_two_candidates_racing_get_one_term_each(
    store_pair: tuple[Any, Any], clock: FakeClock
) -> None:
    """Two candidates standing at once every tick, through lapses: at each tick exactly
    one leads, each term has one owner, and terms only increase."""
    a, b = store_pair
    candidates = [elector(a, "m-a", clock), elector(b, "m-b", clock)]
    owners: dict[int, set[str]] = {}
    last = 0
    for tick in range(12):
        # Both at once, each on its own connection where the store has several.
        await asyncio.gather(*(c.elect() for c in candidates))
        leading = [(c.owner, c.term) for c in candidates if c.term is not None]
        assert len(leading) == 1, leading
        owner, term = leading[0]
        assert term is not None
        assert term >= last
        last = term
        owners.setdefault(term, set()).add(owner)
        # Every third tick the leader is "paused" past its term.
        clock.advance(TTL + 1 if tick % 3 == 2 else 1)
    assert all(len(o) == 1 for o in owners.values())
    assert len(owners) >= 4  # the lapses made new terms


async def test_a_leader_that_stops_trusting_its_term_stands_for_a_new_one(
    store: Any, clock: FakeClock
) -> None:
    """Past TTL - margin on its own clock the leader steps down; standing again, even
    with no rival, gives it a new (higher) term, never the old one back."""
    me = elector(store, "m", clock)
    first = await me.elect()
    assert first is not None
    clock.advance(TTL - 0.5)  # still valid in the store, not trusted by the leader
    assert me.current() is None
    second = await me.elect()
    assert second is not None
    assert second.token > first.token


@pytest.mark.ledger
async def test_a_deposed_leaders_repair_is_refused(store: Any, clock: FakeClock) -> None:
    """reconcile_repair under an old term is refused and repairs nothing."""
    old = await leader_of(store, clock)
    claimed = await running_job(store)
    await store.effect_begin(lease=claimed.lease, key="fx")
    clock.advance(TTL + DEADLINE + 1)
    assert await elector(store, "other", clock).elect() is not None
    found = await store.reconcile_find(pending_deadline=DEADLINE)
    assert [f.kind for f in found] == [Drift.EFFECT_PENDING]
    report = await Reconciler(store, interval=1, pending_deadline=DEADLINE).run_once(leader=old)
    assert report.refused
    assert report.total == 0
    (effect,) = await store.effects_list(key="fx")
    assert effect.status is EffectStatus.PENDING


# -- the reconciler's checks --------------------------------------------------------------
async def _insert_attempt(
    store: Any, request: Any, job_id: int, token: int, outcome: str | None
) -> None:
    """An attempt row written straight into the store, behind its API."""
    now = store.clock.now()
    finished = None if outcome is None else now
    if isinstance(store, MemoryStore):
        row = Attempt(job_id, 1, token, "lost-worker", now, finished, outcome, None, None)
        store._attempts.setdefault(job_id, []).append(row)
        return
    params = (job_id, token, 1, "lost-worker", now, finished, outcome)
    if isinstance(store, SQLiteStore):
        with sqlite3.connect(store.path) as conn:
            conn.execute(
                "INSERT INTO tokenline_attempts (job_id, token, attempt, owner, started_at, "
                "finished_at, outcome) VALUES (?, ?, ?, ?, ?, ?, ?)",
                params,
            )
        return
    import psycopg
    from psycopg import sql

    query = sql.SQL(
        "INSERT INTO {}.attempts (job_id, token, attempt, owner, started_at, finished_at, "
        "outcome) VALUES (%s, %s, %s, %s, %s, %s, %s)"
    ).format(sql.Identifier(store.schema))
    server = request.getfixturevalue("postgres_server")
    async with await psycopg.AsyncConnection.connect(server, autocommit=True) as admin:
        await admin.execute(query, params)


async def reconcile(store: Any, clock: FakeClock) -> Any:
    leader = await leader_of(store, clock)
    service = Reconciler(store, interval=1, pending_deadline=DEADLINE)
    dry = await service.run_once(leader=None, dry_run=True)
    report = await service.run_once(leader=leader)
    assert not report.refused
    assert dry.counts == report.counts  # the dry run saw what the pass repaired
    again = await service.run_once(leader=leader)
    assert again.total == 0, again.lines  # repaired once
    return report


async def _effect_of_own_key(store: Any, claimed: Any, key: str) -> None:
    """The handler's first step: the effect keyed by the job's idempotency key, done."""
    begun = await store.effect_begin(lease=claimed.lease, key=key)
    assert begun.start is Start.RUN
    assert await store.effect_finish(lease=claimed.lease, key=key, result='"charged"')


@pytest.mark.one_store
async def test_reconciler_leaves_a_job_whose_own_effect_completed_before_a_retry(
    store: Any, clock: FakeClock
) -> None:
    """Regression (data loss): a job whose own-key effect completed and whose attempt then
    asked for a retry is not acknowledged; its next attempt runs the rest of the handler."""
    claimed = await running_job(store, key="order:1")
    await _effect_of_own_key(store, claimed, "order:1")
    retry = Finish(claimed.lease, Outcome.RETRY, 1.0, error="retry requested")
    assert await store.jobs_finish(finishes=[retry]) == [True]
    clock.advance(2)  # due again; its lease long released
    report = await reconcile(store, clock)
    assert report.counts == {}
    assert (await store.job_get(job_id=claimed.job.id)).state is not JobState.SUCCEEDED
    (again,) = await store.jobs_claim(owner="w2", queues=Q, limit=1, ttl=5)
    assert again.job.id == claimed.job.id


@pytest.mark.one_store
async def test_reconciler_leaves_a_job_that_crashed_after_its_own_effect(
    store: Any, clock: FakeClock
) -> None:
    """Regression (data loss): a worker killed between the job's own-key effect and the
    rest of its handler leaves a job that is not acknowledged, neither running on the
    expired lease nor once rescued: it runs again."""
    claimed = await running_job(store, key="order:2")
    await _effect_of_own_key(store, claimed, "order:2")
    clock.advance(6)  # the worker died; its lease expired
    assert await store.reconcile_find(pending_deadline=DEADLINE) == []
    assert list((await store.jobs_rescue()).requeued) == [claimed.job.id]
    report = await reconcile(store, clock)
    assert report.counts == {}
    assert (await store.job_get(job_id=claimed.job.id)).state is JobState.QUEUED
    (again,) = await store.jobs_claim(owner="w2", queues=Q, limit=1, ttl=5)
    assert again.job.id == claimed.job.id
    # The effect itself stays done: the next attempt gets its result, not a second run.
    assert (await store.effect_begin(lease=again.lease, key="order:2")).start is Start.DONE


@pytest.mark.one_store
async def test_reconciler_acknowledges_a_job_whose_transaction_committed(
    store: Any, clock: FakeClock, request: pytest.FixtureRequest
) -> None:
    """A queued job with a succeeded attempt recorded (its fenced transaction committed)
    is acknowledged; a job whose lease is still live is left to its owner."""
    live = await running_job(store, ttl=1000)
    await _insert_attempt(store, request, live.job.id, 99, "succeeded")
    jid = await requeued_job(store, clock)
    await _insert_attempt(store, request, jid, 0, "succeeded")
    never_ran = (await store.jobs_enqueue(jobs=[new()]))[0]
    await _insert_attempt(store, request, never_ran, 7, "succeeded")  # not even looked at
    report = await reconcile(store, clock)
    assert report.counts == {Drift.JOB_UNACKNOWLEDGED.value: 1}
    assert (await store.job_get(job_id=jid)).state is JobState.SUCCEEDED
    assert (await store.job_get(job_id=live.job.id)).state is JobState.RUNNING


@pytest.mark.ledger
async def test_reconciler_fails_an_abandoned_pending_effect(store: Any, clock: FakeClock) -> None:
    """An effect left pending by an attempt whose lease is gone is marked failed only
    past the deadline; then the job's next attempt may run it."""
    claimed = await running_job(store)
    await store.effect_begin(lease=claimed.lease, key="charge:7")
    clock.advance(6)  # lease gone, deadline not yet passed
    assert await store.reconcile_find(pending_deadline=DEADLINE) == []
    clock.advance(DEADLINE)
    report = await reconcile(store, clock)
    assert report.counts == {Drift.EFFECT_PENDING.value: 1}
    assert "charge:7" in report.lines[0]
    (effect,) = await store.effects_list(key="charge:7")
    assert effect.status is EffectStatus.FAILED
    await store.jobs_rescue()
    (again,) = await store.jobs_claim(owner="w2", queues=Q, limit=1, ttl=5)
    assert (await store.effect_begin(lease=again.lease, key="charge:7")).start is Start.RUN


@pytest.mark.ledger
async def test_reconciler_expires_an_orphaned_lease_by_token_bump(
    store: Any, clock: FakeClock
) -> None:
    """A resource lease held by a stopped worker is expired with a higher token: the
    gone holder can no longer renew it, and the next holder gets a newer token."""
    rec = WorkerRecord("w-gone", "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)
    rec = await store.worker_register(record=rec, ttl=TTL)
    held = await store.resource_lease_acquire(resource="acct:1", owner="w-gone", ttl=1000)
    assert held is not None
    assert await store.reconcile_find(pending_deadline=DEADLINE) == []  # owner alive
    await store.worker_deregister(worker_id="w-gone", token=rec.token)
    report = await reconcile(store, clock)
    assert report.counts == {Drift.LEASE_ORPHANED.value: 1}
    leases = {lease.resource: lease for lease in await store.resource_leases_list()}
    assert leases["acct:1"].token == held.token + 1
    assert await store.resource_lease_renew(lease=held, ttl=10) is None
    taken = await store.resource_lease_acquire(resource="acct:1", owner="w-new", ttl=10)
    assert taken is not None
    assert taken.token > held.token + 1


async def _member(store: Any, worker_id: str) -> WorkerRecord:
    rec = WorkerRecord(worker_id, "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)
    return await store.worker_register(record=rec, ttl=TTL)


@pytest.mark.ledger
async def test_reconciler_expires_a_job_attempts_lease_whose_worker_is_gone(
    store: Any, clock: FakeClock
) -> None:
    """Regression: a lease taken through ctx.lease is owned by '<worker>/job<id>/t<token>';
    once that worker's membership is over the lease is orphaned and expired. The worker is
    matched by its exact id: an id holding '/' or LIKE wildcards answers for no other
    worker's leases, and a live worker's attempt keeps its lease."""
    gone = "w/gone%_*"  # '/' and wildcards of LIKE and GLOB
    alive_ext = f"{gone}/job9/t9"  # a live worker whose id extends the gone one's
    alive_wild = "w/goneX!x*"  # what the gone id would match as a LIKE pattern
    rec = await _member(store, gone)
    for worker in (alive_ext, alive_wild):
        await _member(store, worker)
    owners = {
        "res:orphan": f"{gone}/job7/t3",
        "res:ext": f"{alive_ext}/job8/t4",
        "res:wild": f"{alive_wild}/job2/t2",
        "res:user": f"{gone}/someone-else",  # not a job attempt's: never judged
    }
    held = {}
    for resource, owner in owners.items():
        lease = await store.resource_lease_acquire(resource=resource, owner=owner, ttl=600)
        assert lease is not None
        held[resource] = lease
    assert await store.reconcile_find(pending_deadline=DEADLINE) == []  # every worker alive
    await store.worker_deregister(worker_id=gone, token=rec.token)
    report = await reconcile(store, clock)
    assert report.counts == {Drift.LEASE_ORPHANED.value: 1}
    assert "res:orphan" in report.lines[0]
    leases = {lease.resource: lease for lease in await store.resource_leases_list()}
    assert leases["res:orphan"].token == held["res:orphan"].token + 1
    assert await store.resource_lease_renew(lease=held["res:orphan"], ttl=10) is None
    for resource in ("res:ext", "res:wild", "res:user"):
        assert leases[resource].token == held[resource].token
        assert await store.resource_lease_renew(lease=held[resource], ttl=600) is not None


@pytest.mark.one_store
async def test_reconciler_closes_an_attempt_left_open(
    store: Any, clock: FakeClock, request: pytest.FixtureRequest
) -> None:
    """An attempt without an outcome whose job moved on is closed as lost; the running
    attempt of a live job is left alone."""
    claimed = await running_job(store, ttl=1000)
    await _insert_attempt(store, request, claimed.job.id, 0, None)
    report = await reconcile(store, clock)
    assert report.counts == {Drift.ATTEMPT_OPEN.value: 1}
    outcomes = {a.token: a.outcome for a in await store.job_attempts(job_id=claimed.job.id)}
    assert outcomes == {0: "lost", claimed.lease.token: None}


@pytest.mark.one_store
async def test_a_repair_of_something_that_changed_since_it_was_seen_is_not_applied(
    store: Any, clock: FakeClock, request: pytest.FixtureRequest
) -> None:
    """Each repair is conditional on what was seen: a job claimed again, or a lease
    taken over, between the find and the repair is left as it now is."""
    jid = await requeued_job(store, clock)
    await _insert_attempt(store, request, jid, 0, "succeeded")
    rec = WorkerRecord("w-gone", "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)
    rec = await store.worker_register(record=rec, ttl=TTL)
    held = await store.resource_lease_acquire(resource="acct:2", owner="w-gone", ttl=TTL)
    assert held is not None
    await store.worker_deregister(worker_id="w-gone", token=rec.token)
    found = await store.reconcile_find(pending_deadline=DEADLINE)
    assert sorted(f.kind.value for f in found) == ["job_unacknowledged", "lease_orphaned"]
    # Meanwhile: a worker claims the job; the lease lapses and someone else takes it.
    (claimed,) = await store.jobs_claim(owner="w2", queues=Q, limit=1, ttl=1000)
    clock.advance(TTL + 1)
    assert await store.resource_lease_acquire(resource="acct:2", owner="w3", ttl=1000)
    leader = await elector(store, "leader", clock).elect()
    assert leader is not None
    assert await store.reconcile_repair(leader=leader, found=found) == [False, False]
    job = await store.job_get(job_id=jid)
    assert (job.state, job.lease_token, job.lease_owner) == (
        JobState.RUNNING,
        claimed.lease.token,
        "w2",
    )
    leases = {lease.resource: lease for lease in await store.resource_leases_list()}
    assert leases["acct:2"].owner == "w3"
    assert leases["acct:2"].token == held.token + 1
