"""A worker's bookkeeping for one in-flight attempt: its lease, its trust window, its
cancellation, and the resource leases it holds. Private to the worker; the handler sees
it through :class:`~tokenline.worker.context.JobContext`."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._jobs import ClaimedJob, Lease
from ..backpressure import FailureKind

if TYPE_CHECKING:
    from .resources import HeldLease

__all__ = ["Slot"]


@dataclass(eq=False)
class Slot:
    """A worker's bookkeeping for one in-flight job (private to the worker)."""

    claimed: ClaimedJob
    #: The worker's cached view of its lease. A cache with an age, and one-sided: it
    #: may only make the worker give up (stop the handler, refuse to commit) once
    #: ``valid_until`` has passed; it never grants anything. Ownership is decided by the
    #: store, which checks the token on every renewal and commit; when the store
    #: refuses what this view still believed, the worker counts a stale read
    #: (:class:`tokenline.events.StaleRead`) and obeys the store.
    lease: Lease
    #: Monotonic deadline after which the worker no longer trusts its lease: the age
    #: limit of the view above (the last renewal's send time + TTL - margin).
    valid_until: float
    #: The worker cancelled the attempt (``cancel_reason`` says why, set first). A flag
    #: the handler's thread reads, never waits on: not a threading.Event, whose lock and
    #: condition cost more to make than anything else a job's start does.
    cancelled: bool = False
    cancel_reason: str | None = None
    #: Why the attempt was cancelled when its hard timeout did it (the worker's own
    #: ``cancel_reason`` stays unset then: the attempt's outcome is still committed).
    timed_out: str | None = None
    task: asyncio.Task[None] | None = None
    completed_in_transaction: bool = False
    #: A ``ctx.transaction()`` of this attempt committed its writes with the job's
    #: completion in the ledger, which the broker has not acknowledged yet (the split
    #: topology): the job is done, whatever the handler does next.
    done_in_ledger: bool = False
    #: Its outcome is being committed: a renewal refused meanwhile means nothing.
    finishing: bool = False
    #: Given back to the store by the worker's cancellation (a drain's timeout, a
    #: fencing, a stop): never twice, which the store would record as a stale write.
    released: bool = False
    #: Resource leases held through ``ctx.lease``; the control plane renews them.
    resources: list[HeldLease] = field(default_factory=list)
    #: Monotonic time of the attempt's hard timeout.
    deadline: float = math.inf
    #: A ``ctx.transaction()`` of this attempt is open.
    in_transaction: bool = False
    #: Monotonic time the attempt started on this worker.
    started_at: float = 0.0
    #: Its handler runs now (counted in the worker's running handlers).
    running: bool = False
    #: Prefetched and not started: the monotonic time it began to wait for a slot.
    waiting_since: float | None = None
    #: How the attempt failed, for the concurrency limiter (None: it did not).
    failure: FailureKind | None = None
    #: Its async handler is being driven by the guard (between start and return).
    guarded: bool = False
    #: The handler ignored its cancellation and is closed at its next resumption.
    abandoned: bool = False
    #: A step of its async handler that held the event loop was logged (once per attempt).
    loop_held_said: bool = False
    #: Its sync handler's thread is inside ``ctx.effect``: its key is being claimed, the
    #: callee runs, or its outcome is being recorded. Written by that thread only. Past
    #: a hard timeout the worker keeps the attempt (its lease renewed) until the effect
    #: is over, for the key stays pending under this attempt until then, and an attempt
    #: that ended would let the next one take the key over and run the callee beside
    #: this one.
    effect_key: str | None = None
    #: Its async handler awaits ``ctx.effect``'s claim, callee or record. A drain timeout
    #: waits for it, as for ``effect_key``, rather than cancel the callee mid-call.
    effect_awaited: str | None = None
    #: Monotonic time the effect (of either kind) began.
    effect_since: float = 0.0

    @property
    def ended(self) -> bool:
        """The worker has ended the attempt: cancelled it, or given a reason alone (a
        drain timeout lets a handler inside an effect run on until it is over). Its
        ``ctx`` calls refuse either way."""
        return self.cancelled or self.cancel_reason is not None
