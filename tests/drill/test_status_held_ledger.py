"""``tokenline status`` on the split topology while a worker holds a ledger transaction
open: what the drill's ``sigstop`` does to it (a worker paused in its fenced transaction).
The ledger is healthy, and status must say so, quickly, without stalling the workers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tokenline.drill._scratch import ScratchStore, scratch_for
from tokenline.drill.statusprobe import STATUS_TIMEOUT
from tokenline.stores import split_url, store_from_url

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]


@pytest.fixture
def split_scratch(postgres_server: str, redis_server: str) -> Iterator[ScratchStore]:
    """A fresh split store (key prefix and schema), its tables created, removed after."""
    scratch = scratch_for(split_url(redis_server, postgres_server), prefix="tokenline_held")
    try:
        scratch.prepare({})
        asyncio.run(_open_and_close(scratch.url))  # as a worker does: the tables exist
        yield scratch
    finally:
        scratch.cleanup()


async def _open_and_close(url: str) -> None:
    store = store_from_url(url)
    await store.open()
    await store.close()


def _status(url: str) -> dict[str, Any]:
    """``tokenline status --json`` as an operator runs it (with the drill's timeout)."""
    done = subprocess.run(
        [sys.executable, "-m", "tokenline", "status", "--url", url, "--json",
         "--timeout", str(STATUS_TIMEOUT)],
        capture_output=True, text=True, timeout=60, check=False, env=dict(os.environ),
    )  # fmt: skip
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_status_calls_the_ledger_ok_while_a_transaction_holds_a_job_fence(
    split_scratch: ScratchStore, postgres_server: str
) -> None:
    """Opening the split store for status must not wait for a transaction that holds a
    job's fence row (a paused worker's): status would call a healthy ledger slow, and
    while it waited every other worker's fence check would queue behind it."""
    import psycopg

    schema = split_scratch.tables["duplicates"].partition(".")[0]
    with psycopg.connect(postgres_server) as held:
        held.execute(
            f"INSERT INTO {schema}.job_fences (job_id, token, owner, updated_at) "
            "VALUES (1, 1, 'paused-worker', 0)"
        )
        report = _status(split_scratch.url)
        held.rollback()
    ledger = report["channels"]["ledger"]
    assert ledger["ok"] is True, ledger


def test_a_worker_opening_the_split_store_does_not_wait_behind_a_held_fence(
    split_scratch: ScratchStore, postgres_server: str
) -> None:
    """A worker starting (a full open, the split tables' set-up included) while another
    holds a job's fence row in an open transaction opens at once: the set-up changes the
    tables only when something is missing, so it takes no lock on them otherwise."""
    import psycopg

    schema = split_scratch.tables["duplicates"].partition(".")[0]
    with psycopg.connect(postgres_server) as held:
        held.execute(
            f"INSERT INTO {schema}.job_fences (job_id, token, owner, updated_at) "
            "VALUES (1, 1, 'paused-worker', 0)"
        )
        held.execute(f"LOCK TABLE {schema}.job_fences IN ROW EXCLUSIVE MODE")
        asyncio.run(asyncio.wait_for(_open_and_close(split_scratch.url), 20))
        held.rollback()
