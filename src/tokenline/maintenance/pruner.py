"""Retention: the leader deletes what is finished and old, in small fenced batches.

What goes, each past its own retention (``WorkerSettings``; defaults in the README):

* ``retention_finished`` (7 days): succeeded and cancelled jobs, with their attempts
  and their released unique keys;
* ``retention_dead`` (30 days): dead jobs, likewise: dead letters are for operators,
  who get longer to look at them;
* ``retention_audit`` (30 days): refused stale commits and recorded duplicates.

What never goes: a queued, scheduled or running job; a unique key that still keeps a
second job out (``unique="always"`` without ``unique_for``); effect records and fences,
which refuse a repeated business effect or a stale write whatever their age. Every
retention is at least the lease TTL (checked at start-up), so no row goes while a
lease that may still write about it can be alive — and a write about a pruned job is
refused anyway (no row holds its token).

**Small batches.** Each batch is its own transaction of at most ``batch`` rows
(:meth:`~tokenline.stores.base.Broker.maintenance_prune`), which first checks that the
leader still holds the maintenance lease: a deposed leader deletes nothing, and no
lock is held for long. Between batches the pruner pauses briefly, so that workers'
claims and finishes (on SQLite, which has one writer at a time) get the lock in turn.
Ages are measured by the store's clock.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from .._config import WorkerSettings
from .._errors import ConfigError, StaleTokenError
from ..stores.base import Broker, PruneKind, ResourceLease, Store
from ._service import ServiceReport

__all__ = ["COUNT_NAMES", "Pruner", "Retention"]

#: The report's count name of each kind.
COUNT_NAMES = {
    PruneKind.FINISHED: "jobs_pruned",
    PruneKind.DEAD: "dead_jobs_pruned",
    PruneKind.STALE_COMMITS: "stale_commits_pruned",
    PruneKind.DUPLICATES: "duplicates_pruned",
}


@dataclass(frozen=True, slots=True)
class Retention:
    """How long each kind is kept (seconds), as :class:`WorkerSettings` validates it."""

    finished: float
    dead: float
    audit: float

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> Retention:
        """The retentions of ``settings``."""
        return cls(settings.retention_finished, settings.retention_dead, settings.retention_audit)

    def ages(self) -> dict[PruneKind, float]:
        """Each kind with its retention."""
        return {
            PruneKind.FINISHED: self.finished,
            PruneKind.DEAD: self.dead,
            PruneKind.STALE_COMMITS: self.audit,
            PruneKind.DUPLICATES: self.audit,
        }


class Pruner:
    """The retention service (``name = "pruner"``); see the module docstring."""

    name = "pruner"

    def __init__(
        self,
        store: Store,
        retention: Retention,
        *,
        interval: float = 60.0,
        batch: int = 1000,
        pause: float = 0.02,
    ) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError("prune_batch", f"must be a whole number >= 1, got {batch!r}")
        if not interval > 0:
            raise ConfigError("prune_interval", f"must be > 0 seconds, got {interval!r}")
        self.store = store
        self.retention = retention
        self.interval = interval
        self.batch = batch
        #: Seconds between two batches of one run: others' turn at the store's locks.
        self.pause = pause
        self.counters: Counter[str] = Counter()

    @classmethod
    def from_settings(cls, store: Store, settings: WorkerSettings) -> Pruner:
        """A pruner configured by ``settings`` (already validated)."""
        return cls(
            store,
            Retention.from_settings(settings),
            interval=settings.prune_interval,
            batch=settings.prune_batch,
        )

    async def run_once(
        self, *, leader: ResourceLease | None, dry_run: bool = False
    ) -> ServiceReport:
        """Prune every kind past its retention; with ``dry_run``, count instead."""
        store = self.store
        report = ServiceReport(self.name, dry_run=dry_run)
        now = await store.store_time()
        for kind, age in self.retention.ages().items():
            before = now - age
            if dry_run:
                n = await store.maintenance_prunable(kind=kind, before=before)
            elif leader is None:
                raise ValueError("run_once needs the leader's lease unless dry_run")
            else:
                n, refused = await self._prune(store, leader, kind, before)
                if refused:
                    report.refused = True
            if n:
                report.counts[COUNT_NAMES[kind]] += n
                verb = "would prune" if dry_run else "pruned"
                report.routine.append(f"{verb} {n} {kind.value} row(s) older than {age:g}s")
            if report.refused:
                break
        if not dry_run:
            self.counters.update(report.counts)
        return report

    async def _prune(
        self, store: Broker, leader: ResourceLease, kind: PruneKind, before: float
    ) -> tuple[int, bool]:
        """Batches of ``kind`` until one comes back short; and whether a newer leader
        refused one."""
        total = 0
        while True:
            try:
                got = await store.maintenance_prune(
                    leader=leader, kind=kind, before=before, limit=self.batch
                )
            except StaleTokenError:
                return total, True
            total += got
            if got < self.batch:
                return total, False
            await asyncio.sleep(self.pause)
