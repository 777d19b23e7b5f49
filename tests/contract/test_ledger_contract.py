"""The ledger contract: unique enqueue, effects, fences, resource leases and duplicates.

Every backend with ``capabilities.ledger`` runs every test here unchanged; tests that
need no ledger (unique enqueue, resource leases) run on broker and lease stores too, the
others are marked ``ledger``. Concurrency tests use ``store_pair`` (two connections where
the backend has them).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline._errors import (
    EffectPendingError,
    InvalidInputError,
    LeaseBusyError,
    NotSupportedError,
    PayloadError,
    StaleTokenError,
)
from tokenline._jobs import Finish, JobState, NewJob, Outcome, Unique
from tokenline._records import DuplicateKind, EffectStatus, Fence, Start
from tokenline.effects import EffectRun, run_effect, run_effect_as
from tokenline.worker.context import JobContext
from tokenline.worker.slot import Slot

Q = ["default"]


def new(key: str | None = None, unique: Unique | None = None, **kw: Any) -> NewJob:
    return NewJob(queue="default", task="t", args="[]", idempotency_key=key, unique=unique, **kw)


async def claim_one(store: Any, owner: str = "w1", ttl: float = 10.0) -> Any:
    (claimed,) = await store.jobs_claim(owner=owner, queues=Q, limit=1, ttl=ttl)
    return claimed


async def effect_count(store: Any) -> int:
    return len(await store.effects_list(limit=1000))


# -- unique enqueue ---------------------------------------------------------------------
async def test_unique_enqueue_returns_the_holders_id(store: Any) -> None:
    """A second unique enqueue of a key returns the first job's id and inserts nothing;
    a job enqueued without unique is not affected by the key."""
    (first,) = await store.jobs_enqueue(jobs=[new("invoice:1", Unique.ALWAYS)])
    (again,) = await store.jobs_enqueue(jobs=[new("invoice:1", Unique.ALWAYS)])
    assert again == first
    assert [j.id for j in await store.jobs_list()] == [first]
    (plain,) = await store.jobs_enqueue(jobs=[new("invoice:1")])
    assert plain != first
    assert len(await store.jobs_list()) == 2


async def test_unique_batch_repeating_a_key_yields_one_job(store: Any) -> None:
    """Within one batch the first job of a key takes it; later ones get its id, in order."""
    ids = await store.jobs_enqueue(
        jobs=[new("k", Unique.ALWAYS), new(), new("k", Unique.ACTIVE), new("j", Unique.ALWAYS)]
    )
    assert ids[0] == ids[2]
    assert len(set(ids)) == 3
    assert sorted(j.id for j in await store.jobs_list()) == sorted(set(ids))


async def test_unique_for_ends_the_hold_by_store_time(store: Any, clock: FakeClock) -> None:
    """With unique_for the key keeps a second job out for that many seconds only."""
    (a,) = await store.jobs_enqueue(jobs=[new("report", Unique.ALWAYS, unique_for=10)])
    clock.advance(9.5)
    assert await store.jobs_enqueue(jobs=[new("report", Unique.ALWAYS, unique_for=10)]) == [a]
    clock.advance(0.5)
    (b,) = await store.jobs_enqueue(jobs=[new("report", Unique.ALWAYS, unique_for=10)])
    assert b != a
    assert await store.jobs_enqueue(jobs=[new("report", Unique.ALWAYS)]) == [b]


async def test_unique_while_active_lets_go_once_the_job_finishes(store: Any) -> None:
    """ACTIVE holds the key until the holder finishes; ALWAYS keeps holding it after."""
    (a,) = await store.jobs_enqueue(jobs=[new("sync:7", Unique.ACTIVE)])
    c = await claim_one(store)
    assert await store.jobs_enqueue(jobs=[new("sync:7", Unique.ACTIVE)]) == [a]
    await store.job_complete(lease=c.lease)
    (b,) = await store.jobs_enqueue(jobs=[new("sync:7", Unique.ACTIVE)])
    assert b != a
    assert (await store.job_get(job_id=b)).state is JobState.QUEUED
    (once,) = await store.jobs_enqueue(jobs=[new("once", Unique.ALWAYS, priority=9)])
    c2 = await claim_one(store)
    assert c2.job.id == once
    await store.job_dead(lease=c2.lease, error="x")
    assert await store.jobs_enqueue(jobs=[new("once", Unique.ALWAYS)]) == [once]


async def test_concurrent_unique_enqueues_yield_one_job(store_pair: tuple[Any, Any]) -> None:
    """Many enqueues of one key at once, over two connections, create exactly one job."""
    a, b = store_pair
    results = await asyncio.gather(
        *[(a if i % 2 else b).jobs_enqueue(jobs=[new("pay:9", Unique.ALWAYS)]) for i in range(24)]
    )
    ids = {jid for (jid,) in results}
    assert len(ids) == 1
    assert [j.id for j in await a.jobs_list()] == list(ids)


#: Batch sizes under and over the size from which PostgreSQL copies a batch in, its
#: unique keys taken by a statement of their own (COPY_THRESHOLD), which must answer
#: exactly as the single statement does.
BATCH_SIZES = [6, 100]


@pytest.mark.parametrize("size", BATCH_SIZES)
async def test_a_unique_batch_keeps_every_rule_of_the_key(
    store: Any, clock: FakeClock, size: int
) -> None:
    """In one batch, small or large: a key held by a stored job gives its id; a key
    whose hold ended (unique_for passed, or an ACTIVE holder finished) is taken anew;
    a key repeated in the batch gives the first job's id; a key without unique is no
    key at all. The answers come in the batch's order, and only new jobs are stored."""
    (held,) = await store.jobs_enqueue(jobs=[new("held", Unique.ALWAYS)])
    (timed,) = await store.jobs_enqueue(jobs=[new("timed", Unique.ALWAYS, unique_for=5)])
    (done,) = await store.jobs_enqueue(jobs=[new("done", Unique.ACTIVE, priority=9)])
    c = await claim_one(store)
    assert c.job.id == done
    await store.job_complete(lease=c.lease)
    clock.advance(5)
    batch = [
        new("held", Unique.ALWAYS),
        new("timed", Unique.ALWAYS),
        new("fresh", Unique.ALWAYS),
        new("done", Unique.ACTIVE),
        new("fresh", Unique.ACTIVE),
        new("held"),
    ]
    batch += [new(f"pad-{i}", Unique.ALWAYS if i % 2 else None) for i in range(size - 6)]
    ids = await store.jobs_enqueue(jobs=batch)
    assert len(ids) == size
    assert ids[0] == held
    assert ids[2] == ids[4]
    new_ids = [ids[1], ids[2], ids[3], ids[5], *ids[6:]]
    assert len(set(new_ids)) == len(new_ids) == size - 2
    assert not set(new_ids) & {held, timed, done}
    assert sorted(new_ids) == new_ids  # in the batch's order
    stored = {j.id for j in await store.jobs_list(limit=1000)}
    assert stored == {held, timed, done, *new_ids}
    # Each key taken in the batch is held by its new job from now on.
    again = [new(k, Unique.ALWAYS) for k in ("timed", "fresh", "done")]
    assert await store.jobs_enqueue(jobs=again) == [ids[1], ids[2], ids[3]]
    if size > 7:
        assert await store.jobs_enqueue(jobs=[new("pad-1", Unique.ALWAYS)]) == [ids[7]]


async def test_large_unique_batches_naming_the_same_keys_at_once_make_one_job_each(
    store_pair: tuple[Any, Any],
) -> None:
    """Two large batches over two connections, the same keys in opposite orders: both
    complete (no deadlock between their key locks), every key makes one job, and both
    batches answer the same id for it."""
    a, b = store_pair
    keys = [f"order:{i}" for i in range(1000)]
    first, second = await asyncio.gather(
        a.jobs_enqueue(jobs=[new(k, Unique.ALWAYS) for k in keys]),
        b.jobs_enqueue(jobs=[new(k, Unique.ALWAYS) for k in reversed(keys)]),
    )
    assert first == list(reversed(second))
    assert len(set(first)) == len(keys)
    assert sorted(j.id for j in await a.jobs_list(limit=2000)) == sorted(first)


# -- effects ----------------------------------------------------------------------------
@pytest.mark.ledger
async def test_effect_runs_once_and_a_repeat_returns_the_stored_result(store: Any) -> None:
    """A completed key answers DONE with its result and records one repeat duplicate."""
    await store.jobs_enqueue(jobs=[new(), new()])
    x, y = await store.jobs_claim(owner="w1", queues=Q, limit=2, ttl=10)
    begin = await store.effect_begin(lease=x.lease, key="email:42")
    assert begin.start is Start.RUN
    assert await store.effect_finish(lease=x.lease, key="email:42", result='{"id":7}')
    again = await store.effect_begin(lease=y.lease, key="email:42")
    assert again.start is Start.DONE
    assert again.record.result == '{"id":7}'
    assert (again.record.job_id, again.record.token) == (x.job.id, x.lease.token)
    (dup,) = await store.duplicates_list()
    assert (dup.key, dup.kind, dup.job_id, dup.token) == (
        "email:42",
        DuplicateKind.REPEAT,
        y.job.id,
        y.lease.token,
    )
    (record,) = await store.effects_list(job_id=x.job.id)
    assert (record.status, record.runs) == (EffectStatus.COMPLETED, 1)


@pytest.mark.ledger
async def test_pending_effect_is_taken_over_only_with_a_newer_token(
    store: Any, clock: FakeClock
) -> None:
    """After the owner lost its lease the newer attempt takes the key; the old token can
    neither record the outcome nor take the key back, and both refusals are recorded.
    So is the takeover, as a rerun: the old run's outcome is unknown, and the audit
    must show that the effect may have happened twice."""
    (jid,) = await store.jobs_enqueue(jobs=[new()])
    old = await claim_one(store, "w1", ttl=5)
    assert (await store.effect_begin(lease=old.lease, key="k")).start is Start.RUN
    clock.advance(6)
    await store.jobs_rescue()
    cur = await claim_one(store, "w2", ttl=5)
    assert cur.lease.token > old.lease.token
    taken = await store.effect_begin(lease=cur.lease, key="k")
    assert (taken.start, taken.record.token, taken.record.runs) == (Start.RUN, cur.lease.token, 2)
    assert not await store.effect_finish(lease=old.lease, key="k", result="1")
    assert (await store.effect_begin(lease=old.lease, key="k")).start is Start.STALE
    assert await store.effect_finish(lease=cur.lease, key="k", result="2")
    (record,) = await store.effects_list(key="k")
    assert (record.status, record.result, record.token) == (
        EffectStatus.COMPLETED,
        "2",
        cur.lease.token,
    )
    stale = [d for d in await store.duplicates_list() if d.key == "k"]
    assert {(d.kind, d.operation, d.token) for d in stale} == {
        (DuplicateKind.REPEAT, "effect_rerun", cur.lease.token),
        (DuplicateKind.STALE, "effect_complete", old.lease.token),
        (DuplicateKind.STALE, "effect_begin", old.lease.token),
    }
    assert (await store.job_get(job_id=jid)).lease_owner == "w2"


@pytest.mark.ledger
async def test_a_key_pending_under_a_live_lease_is_busy_until_that_lease_is_lost(
    store: Any, clock: FakeClock
) -> None:
    """Another job waits while the owner's lease is live, and takes over once it expired."""
    await store.jobs_enqueue(jobs=[new(), new()])
    x = await claim_one(store, "w1", ttl=5)
    y = await claim_one(store, "w2", ttl=60)
    assert (await store.effect_begin(lease=x.lease, key="k")).start is Start.RUN
    busy = await store.effect_begin(lease=y.lease, key="k")
    assert (busy.start, busy.record.owner) == (Start.BUSY, "w1")
    assert await store.duplicates_list() == []  # busy is no duplicate
    clock.advance(5)
    taken = await store.effect_begin(lease=y.lease, key="k")
    assert (taken.start, taken.record.job_id) == (Start.RUN, y.job.id)
    # The first run's outcome is unknown: the takeover is a rerun, in the audit.
    (rerun,) = await store.duplicates_list()
    assert (rerun.key, rerun.kind, rerun.operation, rerun.job_id, rerun.token) == (
        "k",
        DuplicateKind.REPEAT,
        "effect_rerun",
        y.job.id,
        y.lease.token,
    )


@pytest.mark.ledger
async def test_a_failed_effect_may_run_again(store: Any) -> None:
    """A failure is recorded with its error; the same attempt (or another) may rerun it."""
    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store)
    await store.effect_begin(lease=x.lease, key="k")
    assert await store.effect_finish(lease=x.lease, key="k", error="boom")
    (record,) = await store.effects_list(key="k")
    assert (record.status, record.error, record.result) == (EffectStatus.FAILED, "boom", None)
    again = await store.effect_begin(lease=x.lease, key="k")
    assert (again.start, again.record.runs) == (Start.RUN, 2)
    # Its failure said how the first run ended: running it again is no rerun to audit.
    assert await store.duplicates_list() == []


@pytest.mark.ledger
async def test_a_stale_job_token_cannot_begin_an_effect(store: Any, clock: FakeClock) -> None:
    """The job's token is checked first: a rescued attempt is refused before any write."""
    await store.jobs_enqueue(jobs=[new()])
    old = await claim_one(store, ttl=1)
    clock.advance(2)
    await store.jobs_rescue()
    assert (await store.effect_begin(lease=old.lease, key="k")).start is Start.STALE
    assert await store.effects_list() == []
    (dup,) = await store.duplicates_list()
    assert (dup.kind, dup.operation) == (DuplicateKind.STALE, "effect_begin")


@pytest.mark.ledger
async def test_concurrent_effects_from_two_workers_apply_once(
    store_pair: tuple[Any, Any], clock: FakeClock
) -> None:
    """Two jobs on two workers (connections) run one key at the same moment: the effect
    function runs once and both get its result; the second is recorded as a repeat."""
    a, b = store_pair
    await a.jobs_enqueue(jobs=[new(), new()])
    x = await claim_one(a, "w1", ttl=60)
    y = await claim_one(b, "w2", ttl=60)
    calls: list[int] = []

    async def send(n: int) -> dict[str, int]:
        calls.append(n)
        await asyncio.sleep(0.05)
        return {"sent": n}

    results = await asyncio.gather(
        run_effect(a, x.lease, "email:1", send, 1, clock=clock),
        run_effect(b, y.lease, "email:1", send, 2, clock=clock),
    )
    assert len(calls) == 1
    assert results == [{"sent": calls[0]}] * 2
    (dup,) = await a.duplicates_list()
    assert dup.kind is DuplicateKind.REPEAT


@pytest.mark.ledger
async def test_the_older_token_of_a_job_is_refused_once_a_newer_one_took_the_key(
    store: Any, clock: FakeClock
) -> None:
    """A zombie (older token) whose key the current attempt has taken over can neither
    record its outcome nor run the effect again; the current attempt's result stands."""
    await store.jobs_enqueue(jobs=[new()])
    old = await claim_one(store, "w1", ttl=5)
    run_old = EffectRun(store, old.lease, "charge:1", clock=clock, wait=0)
    assert (await run_old.claim()).start is Start.RUN
    clock.advance(6)
    await store.jobs_rescue()
    cur = await claim_one(store, "w2", ttl=60)
    run_cur = EffectRun(store, cur.lease, "charge:1", clock=clock, wait=0)
    assert (await run_cur.claim()).start is Start.RUN
    with pytest.raises(StaleTokenError, match="charge:1"):
        await run_old.completed("zombie")
    assert await run_cur.completed("current") == "current"
    with pytest.raises(StaleTokenError):
        await run_effect(store, old.lease, "charge:1", lambda: "again", clock=clock)
    (record,) = await store.effects_list(key="charge:1")
    assert (record.result, record.token) == ('"current"', cur.lease.token)


@pytest.mark.ledger
async def test_two_tokens_of_one_job_racing_on_a_key_apply_once(
    store_pair: tuple[Any, Any], clock: FakeClock
) -> None:
    """A zombie finishing its effect and the current attempt starting it race over two
    connections: whichever the store serialises first, one completion is recorded and
    the effect is applied by one of them only."""
    a, b = store_pair
    await a.jobs_enqueue(jobs=[new()])
    old = await claim_one(a, "w1", ttl=5)
    run_old = EffectRun(a, old.lease, "charge:1", clock=clock, wait=0)
    assert (await run_old.claim()).start is Start.RUN
    clock.advance(6)
    await b.jobs_rescue()
    cur = await claim_one(b, "w2", ttl=60)
    applied: list[str] = []

    async def charge(who: str) -> str:
        applied.append(who)
        return who

    outcomes = await asyncio.gather(
        run_old.completed("zombie"),
        run_effect(b, cur.lease, "charge:1", charge, "current", clock=clock),
        return_exceptions=True,
    )
    (record,) = await a.effects_list(key="charge:1")
    if isinstance(outcomes[0], StaleTokenError):
        # The current attempt took the key first: the zombie's record is refused.
        assert (outcomes[1], applied, record.token) == ("current", ["current"], cur.lease.token)
    else:
        # The zombie recorded the effect it had applied: the current attempt reuses it.
        assert (outcomes, applied, record.token) == (["zombie"] * 2, [], old.lease.token)
    assert record.status is EffectStatus.COMPLETED


@pytest.mark.ledger
async def test_effect_waits_then_gives_up_on_a_live_owner(store: Any, clock: FakeClock) -> None:
    """With wait=0 a key pending under a live lease raises EffectPendingError at once."""
    await store.jobs_enqueue(jobs=[new(), new()])
    x = await claim_one(store, "w1", ttl=60)
    y = await claim_one(store, "w2", ttl=60)
    await store.effect_begin(lease=x.lease, key="k")
    with pytest.raises(EffectPendingError, match="w1"):
        await run_effect(store, y.lease, "k", lambda: 1, clock=clock, wait=0)


@pytest.mark.parametrize("key", ["", "k" * 256, None, 7])
@pytest.mark.ledger
async def test_a_bad_effect_key_is_refused_before_anything_is_written(
    store: Any, clock: FakeClock, key: Any
) -> None:
    """Empty, too long or non-string keys: InvalidInputError, no ledger row."""
    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store)
    with pytest.raises(InvalidInputError, match="effect key"):
        await run_effect(store, x.lease, key, lambda: 1, clock=clock)
    assert await effect_count(store) == 0


@pytest.mark.ledger
@pytest.mark.parametrize(
    ("result", "max_bytes", "said"),
    [
        ({1, 2}, None, "JSON"),
        (math.nan, None, "JSON"),
        (object(), None, "JSON"),
        ("x" * 100, 64, "over the limit of 64"),
    ],
    ids=["set", "nan", "object", "too-big"],
)
async def test_an_effect_whose_result_cannot_be_stored_never_runs_again(
    store: Any, clock: FakeClock, result: Any, max_bytes: int | None, said: str
) -> None:
    """The effect ran but its result cannot be stored (not JSON, or over the limit):
    PayloadError, and the key is completed without a result, not failed, for a failed
    key would run the effect again. A repeat, by a later attempt too, raises
    PayloadError saying so, and does not call the callee."""
    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store)
    calls: list[int] = []

    def callee() -> Any:
        calls.append(1)
        return result

    run = EffectRun(store, x.lease, "k", clock=clock, wait=0, max_bytes=max_bytes)
    with pytest.raises(PayloadError, match=said):
        await run_effect_as(run, callee)
    (record,) = await store.effects_list()
    assert (record.status, record.result) == (EffectStatus.COMPLETED, None)
    with pytest.raises(PayloadError, match=r"ran once.*could not be stored"):
        await run_effect(store, x.lease, "k", callee, clock=clock)
    clock.advance(11.0)  # the attempt's lease expires: the rescue gives the job back
    await store.jobs_rescue()
    y = await claim_one(store, "w2")
    with pytest.raises(PayloadError, match="ran once"):
        await run_effect(store, y.lease, "k", callee, clock=clock)
    assert calls == [1]


@pytest.mark.ledger
async def test_an_effect_that_raises_is_recorded_failed(store: Any, clock: FakeClock) -> None:
    """The callee's exception propagates and the key is failed with its message."""
    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store)

    def boom() -> None:
        raise ConnectionError("smtp down")

    with pytest.raises(ConnectionError):
        await run_effect(store, x.lease, "k", boom, clock=clock)
    (record,) = await store.effects_list()
    assert (record.status, record.error) == (EffectStatus.FAILED, "ConnectionError: smtp down")
    assert await run_effect(store, x.lease, "k", lambda: "ok", clock=clock) == "ok"


@pytest.mark.ledger
async def test_an_effect_raising_any_message_is_recorded_failed_and_may_run_again(
    store: Any, clock: FakeClock
) -> None:
    """A callee's message with NUL or a lone surrogate is kept escaped: the failed
    record is written (not left pending), so the key may run again at once."""
    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store)

    def boom() -> None:
        raise ConnectionError("reset \x00 by \udcff peer")

    with pytest.raises(ConnectionError):
        await run_effect(store, x.lease, "k", boom, clock=clock)
    (record,) = await store.effects_list()
    assert record.status is EffectStatus.FAILED
    assert record.error == "ConnectionError: reset \\x00 by \\udcff peer"
    assert await run_effect(store, x.lease, "k", lambda: "ok", clock=clock) == "ok"


@pytest.mark.ledger
async def test_an_effect_raising_an_exception_whose_message_cannot_be_read_is_failed(
    store: Any, clock: FakeClock
) -> None:
    """A callee's exception whose ``__str__`` raises still leaves a failed record (not
    a pending one, which would hold the key until its deadline), and propagates."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store)

    def boom() -> None:
        raise Unprintable

    with pytest.raises(Unprintable):
        await run_effect(store, x.lease, "k", boom, clock=clock)
    (record,) = await store.effects_list()
    assert record.status is EffectStatus.FAILED
    assert record.error == "Unprintable: <str() of the exception raised>"


# -- fences -----------------------------------------------------------------------------
@pytest.mark.ledger
async def test_a_fence_keeps_the_highest_token_of_each_issuer(store: Any, clock: FakeClock) -> None:
    """Resource-lease tokens: a later holder's write raises the fence and an earlier
    holder's is refused (recorded); the job's own token is a separate issuer."""
    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store, ttl=60)
    one = await store.resource_lease_acquire(resource="acct:1", owner="a", ttl=5)
    assert await store.fence_write(lease=x.lease, fence=Fence("acct:1", one.token, "acct:1", "a"))
    assert await store.fence_write(lease=x.lease, fence=Fence("acct:1", one.token, "acct:1", "a"))
    clock.advance(6)
    two = await store.resource_lease_acquire(resource="acct:1", owner="b", ttl=5)
    assert two.token > one.token
    assert await store.fence_write(lease=x.lease, fence=Fence("acct:1", two.token, "acct:1", "b"))
    assert not await store.fence_write(
        lease=x.lease, fence=Fence("acct:1", one.token, "acct:1", "a")
    )
    # The job's token is its own issuer: token 1 of the job is not "lower" than lease 2.
    assert await store.fence_write(lease=x.lease, fence=Fence("acct:1", x.lease.token))
    stale = await store.duplicates_list()
    assert [(d.key, d.kind, d.operation, d.token) for d in stale] == [
        ("acct:1", DuplicateKind.STALE, "fence", x.lease.token)
    ]


@pytest.mark.ledger
async def test_a_fence_needs_the_issuing_lease_still_held(store: Any, clock: FakeClock) -> None:
    """An expired resource lease cannot write even if nobody newer has written yet."""
    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store, ttl=60)
    held = await store.resource_lease_acquire(resource="r", owner="a", ttl=5)
    clock.advance(5)
    assert not await store.fence_write(lease=x.lease, fence=Fence("r", held.token, "r", "a"))


@pytest.mark.ledger
async def test_a_fence_from_a_rescued_attempt_is_refused(store: Any, clock: FakeClock) -> None:
    """Job-token fences: the old attempt of a rescued job cannot write, the new one can."""
    await store.jobs_enqueue(jobs=[new()])
    old = await claim_one(store, ttl=1)
    clock.advance(2)
    await store.jobs_rescue()
    cur = await claim_one(store, ttl=60)
    assert await store.fence_write(lease=cur.lease, fence=Fence("invoice:1", cur.lease.token))
    assert not await store.fence_write(lease=old.lease, fence=Fence("invoice:1", old.lease.token))


@pytest.mark.ledger
async def test_a_fenced_transaction_refuses_a_lower_fence_before_user_writes(
    store: Any, clock: FakeClock
) -> None:
    """ctx.transaction(fence=…) on a store with transactions: a refused fence raises
    StaleTokenError on entry and leaves the job running, uncommitted."""
    if not store.capabilities.transactional_completion:
        # Without transactions the store must refuse clearly rather than half-work.
        await store.jobs_enqueue(jobs=[new()])
        x = await claim_one(store, ttl=60)
        with pytest.raises(NotSupportedError, match=r"ctx\.transaction"):
            store.fenced_transaction(lease=x.lease, fences=[])
        return
    await store.jobs_enqueue(jobs=[new()])
    x = await claim_one(store, ttl=60)
    old = await store.resource_lease_acquire(resource="r", owner="a", ttl=5)
    clock.advance(6)
    cur = await store.resource_lease_acquire(resource="r", owner="b", ttl=5)
    assert await store.fence_write(lease=x.lease, fence=Fence("r", cur.token, "r", "b"))
    with pytest.raises(StaleTokenError, match="fence 'r'"):
        async with store.fenced_transaction(
            lease=x.lease, fences=[Fence("r", old.token, "r", "a")]
        ):
            pytest.fail("the block must not run")
    assert (await store.job_get(job_id=x.job.id)).state is JobState.RUNNING
    async with store.fenced_transaction(lease=x.lease, fences=[Fence("r", cur.token, "r", "b")]):
        pass
    assert (await store.job_get(job_id=x.job.id)).state is JobState.SUCCEEDED


# -- resource leases --------------------------------------------------------------------
@pytest.mark.ledger
async def test_lease_renewal_is_fenced_by_owner_and_token(store: Any, clock: FakeClock) -> None:
    """Renewal extends only the holder's unexpired lease; after a takeover the old
    token's renewal and release are refused, and the renewal is recorded as stale."""
    a = await store.resource_lease_acquire(resource="acct:2", owner="a", ttl=5)
    clock.advance(3)
    renewed = await store.resource_lease_renew(lease=a, ttl=5)
    assert renewed.expires_at == pytest.approx(clock.now() + 5)
    assert renewed.token == a.token
    clock.advance(5)
    assert await store.resource_lease_renew(lease=renewed, ttl=5) is None
    b = await store.resource_lease_acquire(resource="acct:2", owner="b", ttl=5)
    assert await store.resource_lease_renew(lease=renewed, ttl=5) is None
    assert not await store.resource_lease_release(lease=renewed)
    assert await store.resource_lease_renew(lease=b, ttl=5) is not None
    (dup,) = await store.duplicates_list()
    assert (dup.key, dup.operation, dup.token, dup.job_id) == (
        "acct:2",
        "resource_lease_renew",
        1,
        None,
    )


def context_for(store: Any, claimed: Any, clock: FakeClock) -> JobContext:
    """A job context as the worker builds it, for a job claimed in the test."""
    slot = Slot(claimed=claimed, lease=claimed.lease, valid_until=math.inf)
    return JobContext(slot=slot, store=store, clock=clock, local_fencing=False)


async def test_resource_lease_exclusive_under_contention(
    store_pair: tuple[Any, Any], clock: FakeClock
) -> None:
    """Many jobs contend for one resource through ctx.lease: one holder at a time, and
    each holder's token is higher than every earlier holder's."""
    a, b = store_pair
    await a.jobs_enqueue(jobs=[new() for _ in range(12)])
    claimed = await a.jobs_claim(owner="w", queues=Q, limit=12, ttl=600)
    holder: list[int] = []
    tokens: list[int] = []

    async def work(i: int, c: Any) -> None:
        ctx = context_for(a if i % 2 else b, c, clock)
        async with ctx.lease("account:42", ttl=600, wait=600) as held:
            assert holder == [], f"{i} acquired while {holder} held the lease"
            holder.append(i)
            tokens.append(held.token)
            await asyncio.sleep(0.002)
            holder.remove(i)

    await asyncio.gather(*[work(i, c) for i, c in enumerate(claimed)])
    assert len(tokens) == 12
    assert tokens == sorted(set(tokens))


async def test_ctx_lease_refuses_bad_ttl_and_reports_a_busy_lease(
    store: Any, clock: FakeClock
) -> None:
    """A non-positive or non-finite TTL is a clear error and no lease row is taken; a
    lease held elsewhere raises LeaseBusyError after the wait."""
    await store.jobs_enqueue(jobs=[new()])
    ctx = context_for(store, await claim_one(store, ttl=60), clock)
    for ttl in (0, -1, math.inf):
        with pytest.raises(InvalidInputError, match="ttl"):
            ctx.lease("r", ttl=ttl)
    with pytest.raises(InvalidInputError, match="lease resource"):
        ctx.lease("", ttl=5)
    assert await store.resource_lease_acquire(resource="r", owner="other", ttl=5) is not None
    with pytest.raises(LeaseBusyError, match="'r'"):
        async with ctx.lease("r", ttl=5):
            pytest.fail("the block must not run")


# -- the audit --------------------------------------------------------------------------
@pytest.mark.ledger
async def test_duplicates_include_refused_job_commits_keyed_by_idempotency_key(
    store: Any, clock: FakeClock
) -> None:
    """The audit lists job-level stale commits under the job's key; ``since`` filters."""
    await store.jobs_enqueue(jobs=[new("invoice:5")])
    old = await claim_one(store, ttl=1)
    clock.advance(2)
    await store.jobs_rescue()
    await claim_one(store)
    before = clock.now()
    clock.advance(1)
    assert await store.jobs_finish(finishes=[Finish(old.lease, Outcome.SUCCEEDED)]) == [False]
    (dup,) = await store.duplicates_list(since=before)
    assert (dup.key, dup.kind, dup.operation, dup.job_id) == (
        "invoice:5",
        DuplicateKind.STALE,
        "succeeded",
        old.job.id,
    )
    assert await store.duplicates_list(since=clock.now() + 1) == []
