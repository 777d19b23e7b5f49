"""A worker's watch over its app's periodic schedules while another process leads.

Only the maintenance leader enqueues periodic jobs, and it runs the schedules of *its
own* app. A leader without a schedule — ``tokenline maintenance`` started without
``--app``, or a worker of an older deploy during a rolling one — never enqueues it,
and never stores its mark either, so the schedule is silently not run. Every worker
whose app has schedules and which does not lead looks, now and then, at the marks the
leader keeps: a schedule whose mark is missing, or behind its latest instant by more
than a leader that runs it could be, is said once per leader's term, naming the leader.
It repairs nothing: the leader's app is the one to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .._errors import NotSupportedError, TokenlineError
from .._periodic import Periodic
from ..stores.base import Store
from .leader import MAINTENANCE_LEASE

__all__ = ["ScheduleWatch"]

log = logging.getLogger("tokenline.maintenance")


class ScheduleWatch:
    """Says which of ``schedules`` the current maintenance leader does not run.

    ``slack``: seconds a leader that runs a schedule may be behind its latest instant
    (its passes, its elections) before the schedule is said not to run."""

    def __init__(
        self, store: Store, schedules: Mapping[str, Periodic], *, owner: str, slack: float
    ) -> None:
        self.store = store
        self.schedules = schedules
        self.owner = owner
        self.slack = slack
        #: (schedule, leader, term) already said: once per term.
        self._said: set[tuple[str, str, int]] = set()

    async def check(self) -> list[str]:
        """Look once; the names of the schedules found not run (each logged once per
        leader's term). Nothing when this process leads, no one does, or the leader's
        term is younger than ``slack``."""
        if not self.schedules:
            return []
        try:
            now = await self.store.store_time()
            leases = await self.store.resource_leases_list()
            marks = await self.store.schedule_marks()
        except NotSupportedError:
            return []
        except TokenlineError as exc:
            log.debug("schedule watch: store not read: %s", exc)
            return []
        held = [r for r in leases if r.resource == MAINTENANCE_LEASE and r.expires_at > now]
        if not held or held[0].owner == self.owner:
            return []
        leader = held[0]
        since = leader.acquired_at if leader.acquired_at is not None else now
        if now - since < self.slack:
            return []  # a new term: its first passes are still to come
        missed = []
        for name, schedule in self.schedules.items():
            mark = marks.get(name)
            latest = schedule.latest(now)
            behind = mark is None or (latest > mark and now - latest > self.slack)
            if not behind:
                continue
            missed.append(name)
            said = (name, leader.owner, leader.token)
            if said in self._said:
                continue
            self._said.add(said)
            log.warning(
                "periodic schedule %r is not being run: the maintenance leader %s (term "
                "%d) has %s; its app may lack the schedule (a `tokenline maintenance` "
                "without --app, or a worker of another deploy): give every process that "
                "stands for maintenance the app with all its schedules",
                name,
                leader.owner,
                leader.token,
                "never started it" if mark is None else f"not enqueued its instant {latest:.0f}",
            )
        return missed
