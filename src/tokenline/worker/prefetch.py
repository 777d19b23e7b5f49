"""How many jobs a worker claims ahead of its running ones under ``prefetch = "auto"``.

A prefetched job is claimed, under its lease, before a handler slot is free for it, so
the next job starts the moment a handler returns while the outcome of the one before is
still being written. That overlap is worth the most when handlers are as short as a
store round trip; for long handlers it saves nothing, and the job waits, leased, where
an idle worker could have run it. ``auto`` therefore follows the worker's recent handler
run times: it prefetches as many jobs as keep a prefetched job's expected wait for a
slot within :data:`AUTO_WAIT` (``ahead / running * run time``), and none while
handlers run longer than that wait. The more handlers run at once, the more of the
store's round trips they already overlap, and the less a prefetched job adds but its
cost (measured: at 50 at once, no-op jobs ran about a tenth slower with 16 prefetched):
``running + ahead`` stays within :data:`AUTO_MAX`, so a worker running that many at
once prefetches nothing. One that still waits :data:`AUTO_PATIENCE` (a job far longer
than the ones before it holds the slot) is given back unrun.
"""

from __future__ import annotations

__all__ = ["AUTO_MAX", "AUTO_PATIENCE", "AUTO_WAIT", "RunTimes", "auto_prefetch"]

#: The expected wait for a slot that ``auto`` allows a prefetched job (seconds).
AUTO_WAIT = 0.02
#: The most jobs ``auto`` holds running and prefetched together: a worker running
#: this many at once prefetches none.
AUTO_MAX = 16
#: A job prefetched by ``auto`` that waited this long for a slot is given back (seconds).
AUTO_PATIENCE = 1.0
#: The weight of the newest run time in the moving average: the last ten or so count.
_WEIGHT = 0.2


class RunTimes:
    """An exponentially weighted moving average of a worker's handler run times."""

    __slots__ = ("mean",)

    def __init__(self) -> None:
        #: The average in seconds; ``None`` until a handler has returned.
        self.mean: float | None = None

    def add(self, seconds: float) -> None:
        """Count one handler's run time (seconds; a negative reading counts as 0)."""
        seconds = max(0.0, seconds)
        if self.mean is None:
            self.mean = seconds
        else:
            self.mean += _WEIGHT * (seconds - self.mean)


def auto_prefetch(mean_run: float | None, running: int) -> int:
    """Jobs to hold prefetched when handlers take ``mean_run`` seconds on average and
    ``running`` of them run at once: as many as keep the expected wait of the last one
    within :data:`AUTO_WAIT`, and at most :data:`AUTO_MAX` minus ``running``; none
    before any handler returned."""
    room = AUTO_MAX - running
    if mean_run is None or running < 1 or room < 1:
        return 0
    if mean_run * room <= AUTO_WAIT * running:
        return room
    return int(AUTO_WAIT * running / mean_run)
