"""The rescuer: running jobs whose lease expired go back to the queue (or dead).

The store does the work in one fenced statement per pass (``jobs_rescue``): each row
is taken only if its lease expired by the store's clock, its token is bumped so the
lost owner can commit nothing, and the whole pass is refused if ``leader`` no longer
holds the maintenance lease.
"""

from __future__ import annotations

from collections import Counter

from .._errors import StaleTokenError
from ..stores.base import Broker, ResourceLease
from ._service import ServiceReport

__all__ = ["Rescuer"]


class Rescuer:
    """Rescue expired job leases every ``interval`` seconds, at most ``limit`` a pass."""

    name = "rescuer"

    def __init__(self, store: Broker, *, interval: float, limit: int = 1000) -> None:
        self.store = store
        self.interval = interval
        self.limit = limit
        self.counters: Counter[str] = Counter()

    async def run_once(
        self, *, leader: ResourceLease | None, dry_run: bool = False
    ) -> ServiceReport:
        """One rescue pass, fenced by ``leader``. With ``dry_run`` nothing is rescued:
        the rescuer cannot say which leases would lapse first without taking them."""
        report = ServiceReport(self.name, dry_run=dry_run)
        if dry_run:
            return report
        if leader is None:
            raise ValueError("the rescuer writes: it needs the leader's lease")
        try:
            done = await self.store.jobs_rescue(limit=self.limit, leader=leader)
        except StaleTokenError as exc:
            report.refused = True
            report.lines.append(f"refused: {exc}")
            self.counters["refused"] += 1
            return report
        for kind, ids in (("requeued", done.requeued), ("dead", done.dead)):
            if ids:
                report.counts[kind] += len(ids)
                report.lines.append(f"rescued {kind}: jobs {list(ids)[:20]}")
        self.counters.update(report.counts)
        return report
