"""Rows of the SQL stores' tables as tokenline's value objects: one mapping for SQLite
and PostgreSQL, whose tables name their columns alike."""

from __future__ import annotations

import dataclasses
import json
import operator
from typing import Any, Protocol

from .._jobs import Attempt, Job, JobState, WorkerRecord
from .._records import Duplicate, DuplicateKind, EffectRecord, EffectStatus

__all__ = [
    "attempt_from_row",
    "duplicate_from_row",
    "effect_from_row",
    "job_from_row",
    "worker_from_row",
]


class _Row(Protocol):
    """A database row readable by column name (``sqlite3.Row``, psycopg's ``dict_row``)."""

    def __getitem__(self, key: str) -> Any: ...


#: Job's fields in order, read once: every claimed job is built from its row.
_JOB_FIELDS = tuple(f.name for f in dataclasses.fields(Job))
_JOB_STATE = _JOB_FIELDS.index("state")
_job_values = operator.itemgetter(*_JOB_FIELDS)
_STATES = {s.value: s for s in JobState}
#: Each field's slot setter, in field order. Job is frozen: its generated ``__init__``
#: sets each of its 21 fields through ``object.__setattr__``, 6 µs a job, half of
#: turning a claimed row into a job; filling the slots directly does the same in a
#: third of that. Job has no ``__post_init__`` that this would skip (checked below).
_JOB_SLOTS = tuple(getattr(Job, name).__set__ for name in _JOB_FIELDS)
if hasattr(Job, "__post_init__"):  # pragma: no cover - a guard for a later change
    raise TypeError("Job has a __post_init__: job_from_row must call Job(...) instead")


def job_from_row(row: _Row) -> Job:
    """The :class:`Job` of a jobs-table row; every store names its columns alike."""
    values = list(_job_values(row))
    state = values[_JOB_STATE]
    values[_JOB_STATE] = _STATES.get(state) or JobState(state)  # an unknown one raises
    job = object.__new__(Job)
    for put, value in zip(_JOB_SLOTS, values, strict=True):
        put(job, value)
    return job


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
        drain_requested=bool(row["drain_requested"]),
        concurrency_limit=row["concurrency_limit"],
    )


def effect_from_row(row: _Row) -> EffectRecord:
    """The :class:`EffectRecord` of an ``effects`` row (a mapping by column name)."""
    return EffectRecord(
        key=row["key"],
        status=EffectStatus(row["status"]),
        result=row["result"],
        error=row["error"],
        job_id=row["job_id"],
        token=row["token"],
        owner=row["owner"],
        runs=row["runs"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        completed_at=row["completed_at"],
    )


def duplicate_from_row(row: _Row) -> Duplicate:
    """The :class:`Duplicate` of a row of the duplicates audit."""
    return Duplicate(
        row["key"],
        DuplicateKind(row["kind"]),
        row["operation"],
        row["job_id"],
        row["token"],
        row["owner"],
        row["at"],
    )
