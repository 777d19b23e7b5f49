"""Maintenance run by one fenced leader: rescue, reconciliation, retention, schedules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._service import Service, ServiceReport
from .leader import MAINTENANCE_LEASE, Leadership
from .reconciler import Reconciler
from .rescuer import Rescuer
from .runner import MaintenanceRunner

if TYPE_CHECKING:
    from .._config import WorkerSettings
    from ..stores.base import Store

__all__ = [
    "MAINTENANCE_LEASE",
    "Leadership",
    "MaintenanceRunner",
    "Reconciler",
    "Rescuer",
    "Service",
    "ServiceReport",
    "standard_services",
]


def standard_services(store: Store, settings: WorkerSettings) -> list[Service]:
    """The services a leader runs, each on its interval from ``settings``."""
    return [
        Rescuer(store, interval=settings.rescue_interval),
        Reconciler(
            store,
            interval=settings.reconcile_interval,
            pending_deadline=settings.effect_pending_deadline,
        ),
    ]
