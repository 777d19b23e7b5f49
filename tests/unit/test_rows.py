"""Rows of the SQL stores' tables as value objects: a claimed job built from its row is
the job its constructor would make, whichever driver's row it comes from."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest

from tokenline._jobs import Job, JobState
from tokenline.stores._rows import job_from_row

ROW = {
    "id": 7,
    "queue": "default",
    "task": "t",
    "args": '{"args": [1], "kwargs": {}}',
    "idempotency_key": "k",
    "priority": 3,
    "run_at": 10.5,
    "attempt": 1,
    "max_attempts": 5,
    "state": "running",
    "lease_owner": "w1",
    "lease_token": 42,
    "lease_expires_at": 40.5,
    "last_error": None,
    "error_class": None,
    "created_at": 9.0,
    "updated_at": 10.0,
    "finished_at": None,
    "timeout": 2.5,
    "lease_expiries": 1,
    "max_lease_expiries": 3,
    "extra_column": "ignored",
}


def _expected() -> Job:
    fields = {f.name for f in dataclasses.fields(Job)}
    kwargs = {k: v for k, v in ROW.items() if k in fields}
    kwargs["state"] = JobState.RUNNING
    return Job(**kwargs)


def _sqlite_row() -> sqlite3.Row:
    conn = sqlite3.connect(":memory:")
    conn.row_factory = sqlite3.Row
    columns = ", ".join(f'? AS "{name}"' for name in reversed(ROW))
    row: sqlite3.Row = conn.execute(f"SELECT {columns}", list(reversed(ROW.values()))).fetchone()
    conn.close()
    return row


@pytest.mark.parametrize("make", [lambda: dict(ROW), _sqlite_row], ids=["mapping", "sqlite"])
def test_a_row_becomes_the_job_its_constructor_makes(make: object) -> None:
    """Every field from its own column (whatever the columns' order), the state as a
    JobState, equal and hashed alike, and frozen like any Job."""
    job = job_from_row(make())  # type: ignore[operator]
    assert job == _expected()
    assert hash(job) == hash(_expected())
    assert repr(job) == repr(_expected())
    assert job.state is JobState.RUNNING
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.lease_token = 43  # type: ignore[misc]


def test_every_state_is_read_and_an_unknown_one_is_refused_by_name() -> None:
    for state in JobState:
        assert job_from_row({**ROW, "state": state.value}).state is state
    with pytest.raises(ValueError, match="'sleeping'"):
        job_from_row({**ROW, "state": "sleeping"})


def test_a_missing_column_is_an_error_not_a_default() -> None:
    row = dict(ROW)
    del row["lease_token"]
    with pytest.raises(KeyError, match="lease_token"):
        job_from_row(row)
