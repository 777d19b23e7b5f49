"""How far this worker's wall clock is from the store's.

Nothing the store decides reads the worker's wall clock — lease expiry, schedules,
rescue and timestamps all use the store's clock — so a skewed worker is still a safe
one. The skew is measured anyway, because an operator comparing a log line with a job's
timestamps, or a clock that jumps by hours, deserves to know: at every heartbeat the
worker reads its wall clock before and after the call, and takes the midpoint against
the time the store wrote into the heartbeat (off by at most half the round trip). The
measurement is stored with the worker's row (``tokenline workers``) and a warning is
logged past ``clock_skew_warning``, at most once a minute.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._clock import Clock

__all__ = ["ClockSkew"]

log = logging.getLogger("tokenline.worker")

#: Shortest time between two warnings about the same worker's skew (seconds).
WARN_EVERY = 60.0


class ClockSkew:
    """The last measured skew of one worker (its wall clock minus the store's)."""

    def __init__(self, clock: Clock, worker_id: str, warn_above: float) -> None:
        self._clock = clock
        self._worker_id = worker_id
        self._warn_above = warn_above
        self._warned_at = -math.inf
        #: Seconds, or ``None`` before the first measurement.
        self.value: float | None = None

    def sent(self) -> float:
        """Read the wall clock as a request that stamps the store's time goes out."""
        return self._clock.now()

    def answered(self, sent_at: float, store_time: float) -> float:
        """Record the skew from a request sent at ``sent_at`` (this worker's wall clock)
        that the store stamped ``store_time``; warn if it is past the threshold."""
        midpoint = (sent_at + self._clock.now()) / 2
        skew = self.value = midpoint - store_time
        now = self._clock.monotonic()
        if abs(skew) > self._warn_above and now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning(
                "worker %s: its wall clock is %+.3fs off the store's (more than %gs); "
                "leases and schedules follow the store's clock, so jobs are unaffected, "
                "but timestamps in this worker's own logs are off by as much",
                self._worker_id,
                skew,
                self._warn_above,
            )
        return skew
