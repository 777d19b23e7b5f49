"""A store call in flight that a stop should let answer rather than cut off.

A claim or an election the store has already granted, cut off by the cancellation of
the task that sent it, leaves what it took held by a stopped process until its lease
expires. The loop that sends such a call marks it; the stop waits, bounded, for it to
settle before cancelling that loop.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["InFlight"]


class InFlight:
    """Whether a call is in flight, and a bounded wait for it to settle."""

    __slots__ = ("_busy", "_settled")

    def __init__(self) -> None:
        self._busy = False
        # Made by the waiter, on its running loop: the object may be built off any loop.
        self._settled: asyncio.Event | None = None

    def started(self) -> None:
        """A call was sent."""
        self._busy = True

    def ended(self) -> None:
        """The call answered, failed, or was given up."""
        self._busy = False
        if self._settled is not None:
            self._settled.set()

    async def settled(self, seconds: float) -> None:
        """Return once no call is in flight, or after ``seconds``."""
        if not self._busy:
            return
        self._settled = settled = asyncio.Event()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await settled.wait()
        finally:
            self._settled = None
