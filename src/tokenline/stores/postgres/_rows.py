"""Rows of the PostgreSQL store's tables, as tokenline's value objects."""

from __future__ import annotations

from psycopg.rows import DictRow

# Jobs share one mapping across stores: every store names its columns alike.
from ..._jobs import WorkerRecord, job_from_row

__all__ = ["job_from_row", "worker_from_row"]


def worker_from_row(row: DictRow) -> WorkerRecord:
    """The :class:`WorkerRecord` of a ``workers`` row."""
    return WorkerRecord(
        id=row["id"],
        host=row["host"],
        pid=row["pid"],
        queues=tuple(row["queues"]),
        concurrency=row["concurrency"],
        state=row["state"],
        token=row["token"],
        started_at=row["started_at"],
        heartbeat_at=row["heartbeat_at"],
        expires_at=row["expires_at"],
        in_flight=row["in_flight"],
        clock_skew=row["clock_skew"],
    )
