"""No switch in tokenline's own code can weaken its guarantees.

The control experiments that prove the checks matter build their sabotaged stores in
the test tree (tests/sabotage.py). Here: no module under ``src/`` names a test-only
unsafe switch, and setting the variables that once were such switches changes nothing
about the stores ``store_from_url`` builds.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import tokenline
from tokenline._clock import FakeClock
from tokenline._jobs import Finish, Lease, NewJob, Outcome
from tokenline.stores import MemoryStore, store_from_url
from tokenline.stores.sqlite import SQLiteStore

SRC = Path(tokenline.__file__).parent
#: Environment variables that once switched protections off in tokenline's own code.
FORMER_SWITCHES = {
    "TOKENLINE_TEST_UNSAFE_DISABLE_FENCING": "1",
    "TOKENLINE_TEST_UNSAFE_SPLIT_COMPLETION": "1",
    "TOKENLINE_DRILL_FAULTS": '{"broker": {"error": true}}',
}


def test_no_module_under_src_names_an_unsafe_switch() -> None:
    """No source or query file of tokenline mentions an UNSAFE switch."""
    offenders = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*")
        if path.suffix in (".py", ".sql", ".lua") and "UNSAFE" in path.read_text()
    ]
    assert offenders == []


def test_former_switches_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every former switch set, store_from_url builds the plain store (no fault
    wrapper) and a stale token's finish is still refused."""
    for name, value in FORMER_SWITCHES.items():
        monkeypatch.setenv(name, value)
    store = store_from_url(f"sqlite:///{tmp_path / 'plain.db'}", clock=FakeClock())
    assert type(store) is SQLiteStore
    assert type(store_from_url("memory://")) is MemoryStore

    async def stale_finish() -> list[bool]:
        await store.open()
        try:
            (jid,) = await store.jobs_enqueue(jobs=[NewJob("default", "t", "[]")])
            (c,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
            zombie = Lease(jid, "zombie", c.lease.token - 1, c.lease.expires_at)
            return await store.jobs_finish(finishes=[Finish(zombie, Outcome.SUCCEEDED)])
        finally:
            await store.close()

    assert asyncio.run(stale_finish()) == [False]
