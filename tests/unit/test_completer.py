"""The batch completer's gathering: finishes wait for company only as long as allowed.

The gathering itself (finishes going out with the refill's claim) is shown through a
worker in test_worker.py; here, its bounds: a refill that asks for more finishes than
will come never holds one past ``GATHER_WAIT``, and one whose answer falls to 1 gets
what is pending sent at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tokenline._jobs import ClaimedJob, Finish, Lease, NewJob, Outcome
from tokenline.stores import MemoryStore
from tokenline.worker import completer
from tokenline.worker.completer import BatchCompleter, ClaimArgs

DEADLINE = 10.0


class _Refill:
    """A refill that claims nothing and asks for ``want`` finishes to be gathered."""

    def __init__(self, want: int) -> None:
        self.want = want

    def reserve(self, freeing: int) -> int:
        return 0

    def claim_args(self) -> ClaimArgs:
        return ClaimArgs(owner="w", queues=["default"], ttl=30.0, priority_aging=None)

    async def take(self, claimed: list[ClaimedJob], sent_at: float) -> None:
        raise AssertionError("nothing is claimed")

    def release(self, reserved: int) -> None:
        pass

    def monotonic(self) -> float:
        return 0.0

    def gather(self) -> int:
        return self.want


class _Batches(MemoryStore):
    """Records the size of every batch of finishes it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        self.sizes.append(len(finishes))
        return await super().jobs_finish(finishes=finishes)


async def _leases(store: MemoryStore, n: int) -> list[Lease]:
    await store.jobs_enqueue(jobs=[NewJob("default", "t", "[]") for _ in range(n)])
    claimed = await store.jobs_claim(owner="w", queues=["default"], limit=n, ttl=30.0)
    return [c.lease for c in claimed]


async def test_a_finish_waits_for_company_at_most_the_gather_wait() -> None:
    """Asked to gather four, a lone finish still goes out, on its own, once it has
    waited GATHER_WAIT; the finishes that do come in time go out together."""
    store = _Batches()
    (a, b, c) = await _leases(store, 3)
    batcher = BatchCompleter(store, refill=_Refill(want=4))
    batcher.start()
    try:
        assert await asyncio.wait_for(batcher.submit(Finish(a, Outcome.SUCCEEDED)), DEADLINE)
        both = asyncio.gather(
            batcher.submit(Finish(b, Outcome.SUCCEEDED)),
            batcher.submit(Finish(c, Outcome.SUCCEEDED)),
        )
        assert await asyncio.wait_for(both, DEADLINE) == [True, True]
    finally:
        await batcher.stop()
    assert store.sizes == [1, 2]


async def test_finishes_held_for_company_go_at_once_when_the_refill_stops_asking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pending finishes held for company (however long they may wait) go out as soon
    as the refill's answer falls to 1 and the completer is woken."""
    monkeypatch.setattr(completer, "GATHER_WAIT", 60.0)
    store = _Batches()
    (a, b) = await _leases(store, 2)
    refill = _Refill(want=4)
    batcher = BatchCompleter(store, refill=refill)
    batcher.start()
    try:
        sent = asyncio.gather(
            batcher.submit(Finish(a, Outcome.SUCCEEDED)),
            batcher.submit(Finish(b, Outcome.SUCCEEDED)),
        )
        for _ in range(20):
            await asyncio.sleep(0)
        assert store.sizes == []  # held: the refill wants four
        refill.want = 1
        batcher.wake()
        assert await asyncio.wait_for(sent, DEADLINE) == [True, True]
    finally:
        await batcher.stop()
    assert store.sizes == [2]


async def test_finishes_made_are_answered_when_the_claim_beside_them_fails() -> None:
    """On a store without a fused finish and claim (the split topology, Redis), the
    claim after a batch's finishes failed (its ledger check could not reach
    PostgreSQL) and the whole call raised: the worker took its accepted give-back
    for a failed one, kept renewing the job, was refused, and fenced itself; its retry
    of the give-back was recorded as a stale write. The finishes' answers now come
    back, with nothing claimed."""
    from tokenline import JobState, StoreUnavailableError

    store = MemoryStore()
    await store.open()
    await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="[]")] * 2)
    (c,) = await store.jobs_claim(owner="w", queues=["q"], limit=1, ttl=30)

    async def unreachable(**kwargs: object) -> list[ClaimedJob]:
        raise StoreUnavailableError("cannot reach PostgreSQL")

    store.jobs_claim = unreachable  # type: ignore[method-assign]
    done, claimed = await store.jobs_finish_and_claim(
        finishes=[Finish(c.lease, Outcome.RELEASE)], owner="w", queues=["q"], limit=1, ttl=30
    )
    assert (done, claimed) == ([True], [])
    job = await store.job_get(job_id=c.job.id)
    assert (job.state, job.lease_owner) == (JobState.QUEUED, None)
    assert await store.stale_commits() == (0, [])
    await store.close()
