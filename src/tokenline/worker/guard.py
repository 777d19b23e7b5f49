"""No step of an async handler begins once its lease is no longer trusted.

An async handler runs in steps, each from one ``await`` that suspends it to the next.
The watchdog cancels handlers when the worker's monotonic clock passes a lease's
``valid_until``, but a cancellation takes effect only when the handler's task next runs,
and the loop runs what fell due in the order it fell due. After a pause (``SIGSTOP``, a
GC or VM stall, another handler's step that held the loop), a handler whose timer or I/O
came due before the watchdog's turn is resumed first, and its next step (an INSERT after
``await asyncio.sleep(...)``) would run on a lease that someone else may hold by now.

:class:`Guarded` closes that gap. It drives the handler's coroutine itself, as the task
would: whatever the coroutine yields goes up to the task unchanged, and what the task
sends or throws comes back down. Before every resumption, the first step included, it
asks a predicate, which for the worker (:class:`LeaseCheck`) reads what the watchdog
reads: the slot's cancel flag and, with ``local_fencing``, ``clock.monotonic()`` against
``valid_until``. If the attempt may no longer run, the coroutine gets ``CancelledError``
at the ``await`` where it waits instead of what it waited for: the code after that
``await`` never runs. The check is made inside the very step that would resume the
handler, so no order of callbacks in the loop can slip a step in between. The handler
must run in the worker's own task for that (``asyncio.timeout``, not ``wait_for``, which
on 3.11 runs it in an inner task that a cancellation reaches one step late).

So: no step begins at or after ``valid_until``, which lies a margin before the store's
expiry (it is measured from when the claim or renewal was sent). What is *not* stopped:

- a step already begun: code between two ``await``\\ s runs to the next one, even if the
  process is paused in the middle of it;
- the handler's own ``except``/``finally`` blocks, which run on cancellation (but a
  handler that catches its cancellation and goes on is *abandoned*: ``call_timeout``
  after its hard timeout, or when its worker stops or fences, the worker cancels it once
  more and the guard closes its coroutine where it waits instead of resuming it);
- a sync handler: its thread runs until it next calls ``ctx`` (every call checks the
  same window) or returns;
- an effect already on its way: a request sent before the pause may land after another
  worker took the job, even though the handler never sees the answer.

A step that runs long holds the whole event loop meanwhile: the worker's renewals, its
heartbeat and every other handler wait for it, so one blocking call (``time.sleep``, a
sync driver, CPU-bound work) in an async handler can cost the jobs beside it their
leases. With a :class:`StepWatch`, each step is timed by the worker's clock, and one
that held the loop for the watch's threshold or longer is reported (the worker logs it,
naming the task, and counts it), so the handler at fault can be found.

Effects outside the store must therefore be fenced where they land: written through
``ctx.transaction()`` (token check and writes in one transaction), behind
``ctx.fenced(key)`` with its token carried into the rows, or sent with the token or the
job's idempotency key so the receiver can refuse a stale or repeated request. The guard
stops stale work early; the store's token check is what refuses a stale commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from .._clock import Clock
    from .slot import Slot

__all__ = ["ABANDONED", "UNTRUSTED", "Guarded", "LeaseCheck", "StepWatch"]

T = TypeVar("T")

#: The cancel reason the guard gives when the worker's clock no longer trusts the lease.
UNTRUSTED = "lease no longer trusted by the worker's clock"
#: What an abandoned handler's task is cancelled with.
ABANDONED = "handler abandoned: it did not stop when cancelled"


class StepWatch:
    """Times each step of a guarded coroutine with ``now()`` and calls ``held(seconds)``
    for one that took ``threshold`` seconds or longer: it held the event loop that long
    (or the process was paused while it ran)."""

    __slots__ = ("held", "now", "threshold")

    def __init__(
        self, threshold: float, now: Callable[[], float], held: Callable[[float], None]
    ) -> None:
        self.threshold = threshold
        self.now = now
        self.held = held


class Guarded(Generic[T]):
    """Await ``coro``, but before each of its steps ask ``stop()``: a reason (a string)
    throws ``CancelledError(reason)`` into it instead of resuming it; None resumes it.

    ``abandon()``, asked before ``stop()``, is for a coroutine that ignores its
    cancellation: true, the coroutine is closed where it waits (its ``finally`` blocks run
    up to their first ``await``) and ``CancelledError`` is raised here, so no handler can
    keep its task, and so its lease, alive by catching ``CancelledError``.

    ``watch``: a :class:`StepWatch` told of each step that held the loop too long.
    """

    __slots__ = ("_abandon", "_coro", "_stop", "_watch")

    def __init__(
        self,
        coro: Coroutine[Any, Any, T],
        stop: Callable[[], str | None],
        abandon: Callable[[], bool] = lambda: False,
        watch: StepWatch | None = None,
    ) -> None:
        self._coro = coro
        self._stop = stop
        self._abandon = abandon
        self._watch = watch

    def __await__(self) -> Generator[Any, Any, T]:
        coro = self._coro
        sent: Any = None
        thrown: BaseException | None = None
        try:
            while True:
                if self._abandon():
                    # RuntimeError: it awaited in a finally block; closed all the same.
                    with contextlib.suppress(RuntimeError):
                        coro.close()
                    raise asyncio.CancelledError(ABANDONED)
                if thrown is None and (reason := self._stop()) is not None:
                    thrown = asyncio.CancelledError(reason)
                watch = self._watch
                began = watch.now() if watch is not None else 0.0
                try:
                    if thrown is None:
                        yielded = coro.send(sent)
                    else:
                        exc, thrown = thrown, None
                        yielded = coro.throw(exc)
                except StopIteration as done:
                    result: T = done.value
                    return result
                finally:
                    if watch is not None and (held := watch.now() - began) >= watch.threshold:
                        watch.held(held)
                try:
                    sent = yield yielded  # a future (or None) for the task, as it was
                except GeneratorExit:
                    raise  # abandoned: the finally below closes the coroutine
                except BaseException as exc:  # thrown in by the task: passed on as it is
                    sent, thrown = None, exc
        finally:
            coro.close()


class LeaseCheck:
    """The worker's predicate for one attempt: why it must stop now, or None.

    A slot already cancelled by the worker (fenced, timed out, stopping) stops with the
    worker's reason. A lease past ``valid_until`` (with ``local_fencing``) stops with
    :data:`UNTRUSTED`, cancels the slot (so ``ctx`` refuses from then on, whatever a later
    renewal says) and sets :attr:`expired`: the worker must then fence itself, as the
    watchdog would have.
    """

    __slots__ = ("_clock", "_local_fencing", "_slot", "expired")

    def __init__(self, slot: Slot, clock: Clock, local_fencing: bool) -> None:
        self._slot = slot
        self._clock = clock
        self._local_fencing = local_fencing
        #: This check found the lease past its trust window and stopped the handler.
        self.expired = False

    def __call__(self) -> str | None:
        slot = self._slot
        if slot.cancelled:
            if slot.cancel_reason is None:
                slot.cancel_reason = "cancelled by the worker"
            return slot.cancel_reason
        if self._local_fencing and self._clock.monotonic() >= slot.valid_until:
            if slot.cancel_reason is None:
                slot.cancel_reason = UNTRUSTED
            slot.cancelled = True
            self.expired = True
            return slot.cancel_reason
        return None
