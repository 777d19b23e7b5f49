"""Rows of the SQL stores' tables as tokenline's value objects: one mapping for SQLite
and PostgreSQL, whose tables name their columns alike."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

from .._jobs import Attempt, Job, JobState, WorkerRecord

__all__ = ["attempt_from_row", "job_from_row", "worker_from_row"]


class _Row(Protocol):
    """A database row readable by column name (``sqlite3.Row``, psycopg's ``dict_row``)."""

    def __getitem__(self, key: str) -> Any: ...


def job_from_row(row: _Row) -> Job:
    """The :class:`Job` of a jobs-table row; every store names its columns alike."""
    values = {f.name: row[f.name] for f in dataclasses.fields(Job)}
    values["state"] = JobState(values["state"])
    return Job(**values)


def attempt_from_row(row: _Row) -> Attempt:
    """The :class:`Attempt` of an attempts-table row."""
    return Attempt(**{f.name: row[f.name] for f in dataclasses.fields(Attempt)})


def worker_from_row(row: _Row) -> WorkerRecord:
    """The :class:`WorkerRecord` of a workers row (queues: an array, or JSON text)."""
    queues = row["queues"]
    return WorkerRecord(
        id=row["id"],
        host=row["host"],
        pid=row["pid"],
        queues=tuple(json.loads(queues) if isinstance(queues, str) else queues),
        concurrency=row["concurrency"],
        state=row["state"],
        token=row["token"],
        started_at=row["started_at"],
        heartbeat_at=row["heartbeat_at"],
        expires_at=row["expires_at"],
        in_flight=row["in_flight"],
        clock_skew=row["clock_skew"],
    )
