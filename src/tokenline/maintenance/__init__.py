"""Maintenance run by one fenced leader: rescue, reconciliation, retention, schedules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._service import Service, ServiceReport
from .leader import MAINTENANCE_LEASE, Leadership
from .pruner import Pruner
from .reconciler import Reconciler
from .rescuer import Rescuer
from .runner import MaintenanceRunner
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .._app import App
    from .._config import WorkerSettings
    from ..stores.base import Store

__all__ = [
    "MAINTENANCE_LEASE",
    "Leadership",
    "MaintenanceRunner",
    "Pruner",
    "Reconciler",
    "Rescuer",
    "Scheduler",
    "Service",
    "ServiceReport",
    "standard_services",
]


def standard_services(
    store: Store, settings: WorkerSettings, app: App | None = None
) -> list[Service]:
    """The services a leader runs, each on its interval from ``settings``: the rescuer,
    the reconciler, the pruner, and the scheduler of ``app``'s periodic jobs (if it has
    any)."""
    services: list[Service] = [
        Rescuer(store, interval=settings.rescue_interval),
        Reconciler(
            store,
            interval=settings.reconcile_interval,
            pending_deadline=settings.effect_pending_deadline,
        ),
        Pruner.from_settings(store, settings),
    ]
    if app is not None and app.periodics:
        services.append(Scheduler.from_settings(store, app, settings))
    return services
