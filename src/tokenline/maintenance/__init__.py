"""Maintenance run by one fenced leader: rescue, reconciliation, retention, schedules."""

from ._service import Service, ServiceReport

__all__ = ["Service", "ServiceReport"]
