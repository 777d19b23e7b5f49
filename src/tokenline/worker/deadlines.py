"""Hard timeouts of a worker's async handlers: one timer per timeout length, not per job.

``asyncio.timeout`` schedules a timer for every attempt and cancels it when the attempt
ends: about 8 µs of a no-op job's time, and a heap of cancelled timers for the loop to
sift. Every attempt of one length of timeout (a task's ``timeout``, the worker's
``job_timeout``) is due in the order it started, so a queue per length, oldest first,
and one timer at its head do the same work: :meth:`Deadlines.start` appends, and
:meth:`Deadlines.end` marks the attempt over. When the timer fires it cancels the task of
every attempt past its deadline and not over, as ``asyncio.timeout`` would, then waits
for the next head.

The queue keeps ended attempts until they reach its head. One long attempt at the head
would hold every later one behind it, however short: the queue is compacted whenever it
grows past twice the attempts still running, so it stays the size of the worker's
concurrency.

:meth:`Deadline.settle` is the ``__aexit__`` of ``asyncio.timeout``: the caller asks it,
after the attempt, whether its deadline cancelled it, and it takes that cancellation
back (``Task.uncancel``) as ``asyncio.timeout`` does.
"""

from __future__ import annotations

import asyncio
import collections

__all__ = ["Deadline", "Deadlines"]


class Deadline:
    """One attempt's hard timeout (see :meth:`Deadlines.start`)."""

    __slots__ = ("_cancelling", "_lane", "at", "expired", "over", "task")

    def __init__(self, lane: _Lane, at: float, task: asyncio.Task[object]) -> None:
        self._lane = lane
        #: When the attempt is due to end, by the loop's clock.
        self.at = at
        self.task = task
        # The task's cancellations already requested when the attempt began.
        self._cancelling = task.cancelling()
        #: The timer cancelled the task for this deadline.
        self.expired = False
        #: The attempt has ended, or its deadline has fired.
        self.over = False

    def settle(self, cancelled: bool) -> bool:
        """End the attempt; whether its deadline cancelled it and nobody else did too.

        ``cancelled``: the attempt ends with ``CancelledError``. When the deadline
        fired, its cancellation is taken back: then, like ``asyncio.timeout``, the
        caller raises ``TimeoutError`` if the attempt ended cancelled and this was the
        only cancellation, and lets a cancellation of anyone else's through."""
        self._lane.end(self)
        if not self.expired:
            return False
        remaining = self.task.uncancel()
        return not cancelled or remaining <= self._cancelling


class _Lane:
    """The attempts of one length of timeout, in the order they started."""

    __slots__ = ("_loop", "handle", "queue", "running")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: collections.deque[Deadline] = collections.deque()
        self.handle: asyncio.TimerHandle | None = None
        self.running = 0

    def end(self, deadline: Deadline) -> None:
        if deadline.over:
            return
        deadline.over = True
        self.running -= 1
        queue = self.queue
        while queue and queue[0].over:
            queue.popleft()
        if len(queue) > 2 * self.running + 64:
            self.queue = collections.deque(d for d in queue if not d.over)
        if not self.queue and self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def fire(self) -> None:
        self.handle = None
        now = self._loop.time()
        queue = self.queue
        while queue and (queue[0].over or queue[0].at <= now):
            deadline = queue.popleft()
            if not deadline.over:
                deadline.over = True
                deadline.expired = True
                self.running -= 1
                deadline.task.cancel()
        if queue:
            self.handle = self._loop.call_at(queue[0].at, self.fire)


class Deadlines:
    """The hard timeouts of the attempts running on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lanes: dict[float, _Lane] = {}

    def start(self, limit: float, task: asyncio.Task[object]) -> Deadline:
        """Cancel ``task`` ``limit`` seconds from now unless the returned deadline is
        settled first."""
        lane = self._lanes.get(limit)
        if lane is None:
            lane = self._lanes[limit] = _Lane(self._loop)
        deadline = Deadline(lane, self._loop.time() + limit, task)
        lane.queue.append(deadline)
        lane.running += 1
        if lane.handle is None:
            lane.handle = self._loop.call_at(lane.queue[0].at, lane.fire)
        return deadline

    def queued(self) -> int:
        """Attempts held in the queues, ended or not (for the tests of their bound)."""
        return sum(len(lane.queue) for lane in self._lanes.values())
