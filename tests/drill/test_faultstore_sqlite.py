"""FaultStore around the SQLite store: the ledger role's faults on fenced transactions,
sync and async, and fencing left intact."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from tokenline._errors import FencedError
from tokenline._jobs import JobState, Lease, NewJob
from tokenline.drill import FaultStore, InjectedFaultError, Role, RoleFaults
from tokenline.stores.sqlite import SQLiteStore


@pytest.fixture
async def running(tmp_path: Path) -> Any:
    """A FaultStore on a SQLite file with an ``effects`` table and one running job."""
    db = tmp_path / "ledger.db"
    inner = SQLiteStore(f"sqlite:///{db}", timeout=5)
    await inner.open()
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE effects (key TEXT NOT NULL)")
    fs = FaultStore(inner)
    await fs.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="{}")])
    (claimed,) = await fs.jobs_claim(owner="w1", queues=["q"], limit=1, ttl=30)
    try:
        yield fs, claimed.lease, db
    finally:
        await inner.close()


def effects(db: Path) -> list[str]:
    """The effect rows committed so far."""
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT key FROM effects")]


def write_effect(fs: FaultStore, lease: Lease, key: str) -> None:
    """A sync handler's body: one business write in the fenced transaction."""
    with fs.fenced_transaction(lease=lease) as conn:
        conn.execute("INSERT INTO effects (key) VALUES (?)", (key,))


async def test_a_lost_ack_on_commit_leaves_the_effect_and_completion_applied(
    running: tuple[FaultStore, Lease, Path],
) -> None:
    """fail_after on the ledger: the transaction commits the effect and the job's
    completion together, and only then does the caller see an error."""
    fs, lease, db = running
    fs.set_role(Role.LEDGER, RoleFaults(fail_after=True))
    with pytest.raises(InjectedFaultError, match="after applying"):
        await asyncio.to_thread(write_effect, fs, lease, "invoice:1")
    assert effects(db) == ["invoice:1"]
    assert (await fs.job_get(job_id=lease.job_id)).state is JobState.SUCCEEDED
    assert fs.injected["ledger.fail_after"] == 1


async def test_a_rolled_back_transaction_is_not_reported_as_a_lost_ack(
    running: tuple[FaultStore, Lease, Path],
) -> None:
    """When the handler's block fails, nothing commits and its own error comes out."""
    fs, lease, db = running
    fs.set_role(Role.LEDGER, RoleFaults(fail_after=True))

    def failing() -> None:
        with fs.fenced_transaction(lease=lease) as conn:
            conn.execute("INSERT INTO effects (key) VALUES ('x')")
            raise ValueError("business rule")

    with pytest.raises(ValueError, match="business rule"):
        await asyncio.to_thread(failing)
    assert effects(db) == []
    assert (await fs.job_get(job_id=lease.job_id)).state is JobState.RUNNING


async def test_a_ledger_error_refuses_the_transaction_before_any_write(
    running: tuple[FaultStore, Lease, Path],
) -> None:
    """An unavailable ledger fails the transaction at its start, sync or async, while
    the broker still answers."""
    fs, lease, db = running
    fs.set_role(Role.LEDGER, RoleFaults(error=True))
    with pytest.raises(InjectedFaultError):
        await asyncio.to_thread(write_effect, fs, lease, "k")
    with pytest.raises(InjectedFaultError):
        async with fs.fenced_transaction(lease=lease):
            pass
    assert effects(db) == []
    assert (await fs.job_get(job_id=lease.job_id)).state is JobState.RUNNING
    fs.clear()
    await asyncio.to_thread(write_effect, fs, lease, "k")
    assert effects(db) == ["k"]


async def test_a_hung_sync_transaction_resumes_when_cleared(
    running: tuple[FaultStore, Lease, Path],
) -> None:
    """A sync handler's transaction hangs on its thread until another thread clears the
    fault, then commits."""
    fs, lease, db = running
    fs.set_role(Role.LEDGER, RoleFaults(hang=True))
    worker = threading.Thread(target=write_effect, args=(fs, lease, "late"))
    worker.start()
    await asyncio.sleep(0.3)
    assert worker.is_alive()
    assert effects(db) == []
    fs.clear()
    await asyncio.to_thread(worker.join, 10)
    assert not worker.is_alive()
    assert effects(db) == ["late"]


async def test_a_stale_token_still_wins_over_a_clean_ledger(
    running: tuple[FaultStore, Lease, Path],
) -> None:
    """The wrapper changes nothing about fencing: a stale lease is refused as before."""
    fs, lease, _db = running
    stale = Lease(lease.job_id, lease.owner, lease.token - 1, lease.expires_at)
    with pytest.raises(FencedError):
        await asyncio.to_thread(write_effect, fs, stale, "k")
