"""The reconciler: finds where the queue, the leases and the ledger disagree, and repairs
each disagreement once, fenced, reporting and counting it by kind.

Checks (:class:`~tokenline.stores.base.Drift`), each a read, then a repair that the store
applies only if the leader still holds its term *and* the thing is still as it was
seen (the job's token and state, the effect's token, the lease's token):

* ``job_unacknowledged``: the job's fenced transaction committed (an attempt
  succeeded), yet the job is still queued, scheduled, or running on an expired lease:
  acknowledge it (succeeded). A completed effect of the job's own key is not enough: it
  proves the effect ran, not that the rest of the handler did.
* ``effect_pending_expired``: an effect key left ``pending`` past
  ``effect_pending_deadline`` by an attempt whose lease is gone: mark it ``failed`` so
  the job's next attempt may run it, and flag it (a warning line).
* ``lease_orphaned``: a resource lease held by a worker whose membership is over:
  expire it by bumping its token, never by a delete.
* ``attempt_open``: an attempt without an outcome whose job moved on: close it as lost.
* ``job_lost_from_broker`` (the split topology only): a job the ledger has seen and not
  completed that the broker no longer holds at all. It cannot be repaired: it is
  flagged, once, and reported with the reason (a warning line).

On the split topology (broker and leases on Redis, the ledger on PostgreSQL) each check
reads one side and asks the other, and the repairs are fenced on both: see
``stores/split/maintenance.py``. The reconciler is the same: the store compares.
"""

from __future__ import annotations

import logging
from collections import Counter

from .._errors import StaleTokenError
from ..stores.base import Drift, Inconsistency, Ledger, ResourceLease
from ._service import ServiceReport

__all__ = ["Reconciler"]

log = logging.getLogger("tokenline.maintenance")


class Reconciler:
    """Find and repair drift every ``interval`` seconds (see the module docstring)."""

    name = "reconciler"

    def __init__(
        self,
        store: Ledger,
        *,
        interval: float,
        pending_deadline: float,
        limit: int = 1000,
    ) -> None:
        self.store = store
        self.interval = interval
        self.pending_deadline = pending_deadline
        self.limit = limit
        self.counters: Counter[str] = Counter()

    async def find(self) -> list[Inconsistency]:
        """Every disagreement the store reports now (reads only)."""
        return await self.store.reconcile_find(
            pending_deadline=self.pending_deadline, limit=self.limit
        )

    async def run_once(
        self, *, leader: ResourceLease | None, dry_run: bool = False
    ) -> ServiceReport:
        """One pass: find, then (unless ``dry_run``) repair, fenced by ``leader``."""
        report = ServiceReport(self.name, dry_run=dry_run)
        found = await self.find()
        if dry_run or not found:
            for item in found:
                report.counts[item.kind.value] += 1
                verb = "would flag" if item.kind is Drift.JOB_LOST else "would repair"
                report.lines.append(f"{verb} {item.kind.value}: {item.describe()}")
            return report
        if leader is None:
            raise ValueError("the reconciler repairs: it needs the leader's lease")
        try:
            applied = await self.store.reconcile_repair(leader=leader, found=found)
        except StaleTokenError as exc:
            report.refused = True
            report.lines.append(f"refused: {exc}")
            self.counters["refused"] += 1
            return report
        for item, ok in zip(found, applied, strict=True):
            if ok:
                report.counts[item.kind.value] += 1
                verb = "flagged" if item.kind is Drift.JOB_LOST else "repaired"
                report.lines.append(f"{verb} {item.kind.value}: {item.describe()}")
                if item.kind is Drift.EFFECT_PENDING:
                    log.warning("flagged: %s; marked failed so it may run again", item.describe())
                if item.kind is Drift.JOB_LOST:
                    log.warning("flagged: %s", item.describe())
            else:
                self.counters["changed_since"] += 1
        self.counters.update(report.counts)
        return report
