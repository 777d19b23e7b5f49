"""All time flows through a Clock.

Durations and lease validity use the monotonic clock (it keeps counting while a process
is stopped, so a resumed process sees the gap); timestamps stored in a job use UTC epoch
seconds. Tests inject :class:`FakeClock` and advance it by hand: no sleeps.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    """Source of wall-clock and monotonic time."""

    def now(self) -> float:
        """UTC time as epoch seconds."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...


class SystemClock:
    """The real clocks of this machine."""

    def now(self) -> float:
        """UTC time as epoch seconds."""
        return time.time()

    def monotonic(self) -> float:
        """``time.monotonic()``: counts on while the process is stopped."""
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to; both readings advance together."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._mono = 1000.0

    def now(self) -> float:
        """The fake UTC time."""
        return self._now

    def monotonic(self) -> float:
        """The fake monotonic time."""
        return self._mono

    def advance(self, seconds: float) -> None:
        """Move both clocks forward by ``seconds``."""
        if seconds < 0:
            raise ValueError("a clock never goes backwards")
        self._now += seconds
        self._mono += seconds
