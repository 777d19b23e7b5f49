"""Batches finalising writes: one store round trip for every job that finished meanwhile.

While one batch is in flight, new finishes queue up and go together in the next. Each
row is still fenced by its own token inside the store.

With a :class:`Refill`, a batch also claims the next jobs for the slots it frees
(:meth:`~tokenline.stores.base.Broker.jobs_finish_and_claim`): a worker running one job
at a time then pays one round trip per job instead of two. The claimed jobs are handed
to the refill, which starts them, before the finished jobs' callers hear back, so the
worker never sees a free slot that a claim in flight will fill.

A refill may also ask for finishes to be gathered (:meth:`Refill.gather`): a worker with
prefetched jobs keeps its handlers busy meanwhile, so its finishes wait, at most
:data:`GATHER_WAIT`, to go out together with the claim that refills it, one statement
for several jobs instead of one per job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .._jobs import ClaimedJob, Finish
from ..stores.base import Store

__all__ = ["GATHER_WAIT", "BatchCompleter", "ClaimArgs", "Refill"]

log = logging.getLogger("tokenline.worker")

#: The longest a finish waits for others to go out with (see :meth:`Refill.gather`):
#: how much later a finished job may be recorded, and acknowledged, than it would be.
GATHER_WAIT = 0.02


@dataclass(frozen=True, slots=True)
class ClaimArgs:
    """The claim's arguments besides its size (see ``Broker.jobs_claim``)."""

    owner: str
    queues: Sequence[str]
    ttl: float
    priority_aging: float | None


class Refill(Protocol):
    """Who claims with a batch: the worker, which knows its free slots."""

    def reserve(self, freeing: int) -> int:
        """How many jobs to claim with a batch that frees ``freeing`` slots, reserved
        until :meth:`release` (0: none)."""
        ...

    def claim_args(self) -> ClaimArgs:
        """The claim's arguments besides its size."""
        ...

    async def take(self, claimed: list[ClaimedJob], sent_at: float) -> None:
        """Start the jobs claimed with a batch sent at monotonic time ``sent_at``."""
        ...

    def release(self, reserved: int) -> None:
        """Give back a reservation of :meth:`reserve`."""
        ...

    def monotonic(self) -> float:
        """The worker's monotonic clock."""
        ...

    def gather(self) -> int:
        """How many finishes to gather before sending them (1: send at once); asked
        again whenever the completer is woken (:meth:`BatchCompleter.wake`)."""
        ...


class BatchCompleter:
    """Collects :class:`Finish` requests and writes them in batches."""

    def __init__(self, store: Store, *, max_batch: int = 500, refill: Refill | None = None) -> None:
        self._store = store
        self._max_batch = max_batch
        self._refill = refill
        self._pending: list[tuple[Finish, asyncio.Future[bool]]] = []
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        #: Loop time the oldest pending finish arrived (see _gathered).
        self._first_at = 0.0
        self._stopping = False

    def start(self) -> None:
        """Start the background flusher on the running loop."""
        self._runner = asyncio.create_task(self._run(), name="tokenline-completer")

    async def stop(self) -> None:
        """Flush what is pending, then stop.

        A batch in flight is let finish, never cut off: its claim may already have
        leased jobs to the worker, which the refill gives back unrun once they arrive
        (the worker is stopping); cut off, they would stay leased to a stopped worker
        until the lease ran out. Each store call is bounded by the store itself."""
        runner = self._runner
        if runner is None:
            return
        self._stopping = True
        self._wake.set()
        try:
            await asyncio.wait({runner})
        except asyncio.CancelledError:
            runner.cancel()
            raise
        finally:
            self._runner = None
        if not runner.cancelled() and (exc := runner.exception()) is not None:
            log.error("the batch completer crashed; flushing what it left", exc_info=exc)
        while self._pending:
            await self._flush()

    async def submit(self, finish: Finish) -> bool:
        """Queue ``finish`` and wait for the store's verdict (True: accepted)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if not self._pending:
            self._first_at = asyncio.get_running_loop().time()
        self._pending.append((finish, fut))
        self._wake.set()
        if self._runner is None:
            await self._flush()
        return await fut

    def wake(self) -> None:
        """Have the completer ask :meth:`Refill.gather` again (the refill's answer may
        have changed: nothing left to run meanwhile, a stop, a fence)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._gathered()
                await self._flush()
                if self._pending:
                    # The jobs of the batch just answered free their slots on their own
                    # turns: let them, or the next batch would count them as running,
                    # claim that many fewer, and leave the fetch loop to claim the rest
                    # in a statement of its own.
                    await asyncio.sleep(0)
            if self._stopping:
                return

    async def _gathered(self) -> None:
        """Return once the pending finishes should go: as many as the refill asks to
        gather, or the first of them has waited :data:`GATHER_WAIT`."""
        refill = self._refill
        if refill is None:
            return
        deadline = self._first_at + GATHER_WAIT
        loop = asyncio.get_running_loop()
        while len(self._pending) < min(refill.gather(), self._max_batch):
            left = deadline - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._wake.wait()

    async def _flush(self) -> None:
        batch = self._pending[: self._max_batch]
        del self._pending[: len(batch)]
        if not batch:
            return
        finishes = [f for f, _ in batch]
        refill = self._refill
        limit = refill.reserve(len(batch)) if refill is not None else 0
        try:
            try:
                if refill is not None and limit > 0:
                    sent_at = refill.monotonic()
                    args = refill.claim_args()
                    results, claimed = await self._store.jobs_finish_and_claim(
                        finishes=finishes,
                        owner=args.owner,
                        queues=args.queues,
                        limit=limit,
                        ttl=args.ttl,
                        priority_aging=args.priority_aging,
                    )
                    await refill.take(claimed, sent_at)
                else:
                    results = await self._store.jobs_finish(finishes=finishes)
            finally:
                if refill is not None and limit > 0:
                    refill.release(limit)
        except Exception as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), ok in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(ok)
