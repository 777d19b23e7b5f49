"""Rows of the PostgreSQL store's tables, as tokenline's value objects."""

from __future__ import annotations

from psycopg.rows import DictRow

from ..._jobs import Job, JobState, WorkerRecord

__all__ = ["job_from_row", "worker_from_row"]


def job_from_row(row: DictRow) -> Job:
    """The :class:`Job` of a ``jobs`` row."""
    return Job(
        id=row["id"],
        queue=row["queue"],
        task=row["task"],
        args=row["args"],
        idempotency_key=row["idempotency_key"],
        priority=row["priority"],
        run_at=row["run_at"],
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        state=JobState(row["state"]),
        lease_owner=row["lease_owner"],
        lease_token=row["lease_token"],
        lease_expires_at=row["lease_expires_at"],
        last_error=row["last_error"],
        error_class=row["error_class"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
        timeout=row["timeout"],
    )


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
    )
