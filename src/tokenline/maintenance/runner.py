"""The runner: stands for election, and while leader runs each service on its interval.

One task keeps the term (:meth:`Leadership.elect` every ``renew_interval``), and one task
per service sleeps its own interval, then runs it once with the lease the leadership
trusts *now* (never a lease read before the sleep). A service whose write the store
refused (a newer term exists) makes the leader step down at once. The worker runs one
of these beside its control plane; ``tokenline maintenance`` runs one alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence

from .. import events
from .._errors import ConfigError, TokenlineError
from .._inflight import InFlight
from ._service import Service, ServiceReport
from .leader import Leadership

__all__ = ["MaintenanceRunner"]

log = logging.getLogger("tokenline.maintenance")


class MaintenanceRunner:
    """Run ``services`` while ``leadership`` holds its term.

    ``may_lead``: asked before standing and before each run (a fenced or stopping worker
    answers no). ``on_report``: called with each report that did something.
    """

    def __init__(
        self,
        leadership: Leadership,
        services: Sequence[Service],
        *,
        renew_interval: float,
        may_lead: Callable[[], bool] = lambda: True,
        on_report: Callable[[ServiceReport], None] | None = None,
    ) -> None:
        for service in services:
            interval = service.interval
            if isinstance(interval, bool) or not isinstance(interval, int | float):
                raise ConfigError(f"{service.name}.interval", f"must be a number, got {interval!r}")
            if not math.isfinite(interval) or interval <= 0:
                raise ConfigError(
                    f"{service.name}.interval",
                    f"must be a positive finite number of seconds, got {interval!r}",
                )
        self.leadership = leadership
        self.services = list(services)
        self.renew_interval = renew_interval
        self.may_lead = may_lead
        self.on_report = on_report
        # The term last announced (LeaderChanged), so each change is announced once.
        self._announced: int | None = None
        # An election in flight, which a stop lets answer (see run).
        self._election = InFlight()

    async def run_once(self) -> list[ServiceReport] | None:
        """Stand (or renew), then, if leader, run every service once; ``None`` if not
        leader. For tests and one-off passes."""
        lease = await self.leadership.elect() if self.may_lead() else None
        self._announce()
        if lease is None:
            return None
        return await self.run_services()

    async def run_services(self) -> list[ServiceReport]:
        """Run every service once with the term held now, without standing first (a
        service run without a trusted term is reported refused)."""
        return [await self._run(service) for service in self.services]

    async def run(self) -> None:
        """Stand and run the services until cancelled; then give the lease back, the
        term of an election still answering included."""
        tasks = [asyncio.create_task(self._keep_term(), name="tokenline-leader")]
        tasks += [
            asyncio.create_task(self._loop(s), name=f"tokenline-{s.name}") for s in self.services
        ]
        try:
            # wait, not gather: cancelling this task must not cancel an election in
            # flight before it has been let answer, below.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.cancelled():
                    raise asyncio.CancelledError
                if (exc := t.exception()) is not None:
                    raise exc
        finally:
            # The store may already have granted the election a term: cut off, nobody
            # would give it back (resign() gives back only a term it heard of), and
            # the others would wait out its TTL to lead. At most one renew interval.
            await self._election.settled(self.renew_interval)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.leadership.resign()

    async def _keep_term(self) -> None:
        while True:
            if self.may_lead():
                self._election.started()
                try:
                    await self.leadership.elect()
                except TokenlineError as exc:
                    log.warning("maintenance election failed: %s", exc)
                finally:
                    self._election.ended()
            elif self.leadership.current() is not None:
                # Fenced or stopping: give the term back now rather than at its expiry.
                self.leadership.step_down("this process may not lead now")
                await self.leadership.resign()
            self._announce()
            await asyncio.sleep(self.renew_interval)

    def _announce(self) -> None:
        term = self.leadership.term
        if term != self._announced:
            self._announced = term
            if events.enabled():
                events.emit(events.LeaderChanged(self.leadership.owner, term))

    async def _loop(self, service: Service) -> None:
        while True:
            await asyncio.sleep(service.interval)
            if not self.may_lead() or self.leadership.current() is None:
                continue
            try:
                await self._run(service)
            except TokenlineError as exc:
                # A service that fails (a store error, a store that lacks what it needs)
                # is retried at its next interval; it never takes the worker down.
                log.warning("maintenance %s failed: %s", service.name, exc)
            except Exception:
                # A bug (in a service, a schedule, a store): maintenance runs in every
                # worker, so letting it out would stop every worker of the fleet.
                log.exception("maintenance %s failed unexpectedly; it runs again", service.name)

    async def _run(self, service: Service) -> ServiceReport:
        lease = self.leadership.current()
        if lease is None:
            return ServiceReport(service.name, refused=True)
        report = await service.run_once(leader=lease)
        if report.refused:
            self.leadership.step_down(f"the store refused the {service.name}'s write")
        for line in report.lines:
            log.warning("%s (term %d): %s", service.name, lease.token, line)
        for line in report.routine:  # expected work: a periodic job's enqueue every minute
            log.info("%s (term %d): %s", service.name, lease.token, line)
        if events.enabled():
            for kind, n in report.counts.items():
                events.emit(
                    events.MaintenanceRepaired(self.leadership.owner, service.name, kind, n)
                )
        if self.on_report is not None and (report.total or report.refused):
            self.on_report(report)
        return report
