"""The reconciler: finds where the queue, the leases and the ledger disagree, and repairs
each disagreement once, fenced, reporting and counting it by kind.

Checks (:class:`~tokenline.stores.base.Drift`), each a read, then a repair that the store
applies only if the leader still holds its term *and* the thing is still as it was
seen (the job's token and state, the effect's token, the lease's token):

* ``job_unacknowledged``: the job's fenced transaction committed (an attempt
  succeeded), or its own effect (keyed by its idempotency key) completed, yet the job is
  still queued, scheduled, or running on an expired lease: acknowledge it (succeeded).
* ``effect_pending_expired``: an effect key left ``pending`` past
  ``effect_pending_deadline`` by an attempt whose lease is gone: mark it ``failed`` so
  the job's next attempt may run it, and flag it (a warning line).
* ``lease_orphaned``: a resource lease held by a worker whose membership is over:
  expire it by bumping its token, never by a delete.
* ``attempt_open``: an attempt without an outcome whose job moved on: close it as lost.
* The split topology (broker and leases on one store, ledger on another) adds one more
  check, broker or lease state that disagrees with the ledger: :meth:`Reconciler.
  split_topology_drift` is its hook, empty until a split store exists.
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

    async def split_topology_drift(self) -> list[Inconsistency]:
        """Hook for the split topology: broker or lease state that disagrees with the
        ledger on another store. A single store keeps them in one database, so there is
        nothing to compare; a split store will report its disagreements here."""
        return []

    async def find(self) -> list[Inconsistency]:
        """Every disagreement the store and the hooks report now (reads only)."""
        found = await self.store.reconcile_find(
            pending_deadline=self.pending_deadline, limit=self.limit
        )
        return found + await self.split_topology_drift()

    async def run_once(
        self, *, leader: ResourceLease | None, dry_run: bool = False
    ) -> ServiceReport:
        """One pass: find, then (unless ``dry_run``) repair, fenced by ``leader``."""
        report = ServiceReport(self.name, dry_run=dry_run)
        found = await self.find()
        if dry_run or not found:
            for item in found:
                report.counts[item.kind.value] += 1
                report.lines.append(f"would repair {item.kind.value}: {item.describe()}")
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
                report.lines.append(f"repaired {item.kind.value}: {item.describe()}")
                if item.kind is Drift.EFFECT_PENDING:
                    log.warning("flagged: %s; marked failed so it may run again", item.describe())
            else:
                self.counters["changed_since"] += 1
        self.counters.update(report.counts)
        return report
