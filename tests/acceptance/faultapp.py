"""Tasks driven by the acceptance tests through the real CLI.

``FAULTAPP_LOSE_ACK=<marker file>`` makes the worker's store drop the first success
commit it is asked for, while reporting it accepted: the ack is lost after the work
was done, as when a network cuts the answer off. The marker records the job's id.
``FAULTAPP_STATE_ONLY=1`` gives the worker a store without its token checks
(``tests/sabotage.py``), for the control experiment. ``FAULTAPP_FAULT_FILE=<path>``
wraps the worker's store in the drill's FaultStore driven by that fault file, so a test
can fail one role (broker, leases, ledger) of a running worker.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenline
from tokenline._jobs import ClaimedJob, Finish, Outcome
from tokenline.stores import Store
from tokenline.stores.base import Broker
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite.store import path_from_url


class _LosingAckStore(SQLiteStore):
    """A SQLite store whose first success commit never reaches the file."""

    def __init__(self, url: str, *, marker: Path, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._marker = marker

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        lost = next((f for f in finishes if f.outcome is Outcome.SUCCEEDED), None)
        if lost is None or self._marker.exists():
            return await super().jobs_finish(finishes=finishes)
        self._marker.write_text(str(lost.lease.job_id))
        rest = [f for f in finishes if f is not lost]
        sent = iter(await super().jobs_finish(finishes=rest) if rest else [])
        return [True if f is lost else next(sent) for f in finishes]

    async def jobs_finish_and_claim(
        self, *, finishes: Sequence[Finish], **claim: Any
    ) -> tuple[list[bool], list[ClaimedJob]]:
        # Through jobs_finish above, then the claim: the worker's usual way to commit
        # loses the ack too.
        return await Broker.jobs_finish_and_claim(self, finishes=finishes, **claim)


class FaultApp(tokenline.App):
    """The test app; its workers lose one ack when ``FAULTAPP_LOSE_ACK`` is set."""

    def open_store(self, *, timeout: float | None = None) -> Store:
        if os.environ.get("FAULTAPP_STATE_ONLY") == "1":
            from sabotage import StateOnlySQLiteStore

            return StateOnlySQLiteStore(self.url, timeout=timeout or self.settings.store_timeout)
        fault_file = os.environ.get("FAULTAPP_FAULT_FILE")
        if fault_file:
            from tokenline.drill.faultstore import FaultStore

            return FaultStore(super().open_store(timeout=timeout), fault_file=fault_file)
        marker = os.environ.get("FAULTAPP_LOSE_ACK")
        if not marker:
            return super().open_store(timeout=timeout)
        return _LosingAckStore(
            self.url,
            marker=Path(marker),
            timeout=timeout or self.settings.store_timeout,
        )


app = FaultApp()


@app.task(name="slow_effect", queue="acc", max_attempts=5)
def slow_effect(
    ctx: tokenline.JobContext, key: str, first_sleep: float, later_sleep: float
) -> None:
    """Sleep (long on the first attempt), then write one effect row, fenced."""
    time.sleep(first_sleep if ctx.token == 1 else later_sleep)
    with ctx.transaction() as conn:
        conn.execute(
            "INSERT INTO effects (key, job_id, token, worker) VALUES (?, ?, ?, ?)",
            (key, ctx.job_id, ctx.token, ctx.lease.owner),
        )


def _charge(key: str, job_id: int, token: int, worker: str) -> dict[str, Any]:
    """The external side effect: a row written on a connection of its own, outside any
    transaction of tokenline's (as a payment API or a mail server would be)."""
    effect = tokenline.current_effect()
    assert effect is not None
    assert effect.key == key
    conn = sqlite3.connect(path_from_url(app.url), timeout=30, isolation_level=None)
    try:
        conn.execute(
            "INSERT INTO effects (key, job_id, token, worker) VALUES (?, ?, ?, ?)",
            (key, job_id, token, worker),
        )
    finally:
        conn.close()
    return {"charged": key, "token": token}


@app.task(name="charge_once", queue="acc", max_attempts=5)
def charge_once(ctx: tokenline.JobContext, key: str) -> None:
    """Charge once per key through ctx.effect, however often the job is delivered."""
    receipt = ctx.effect(key, _charge, key, ctx.job_id, ctx.token, ctx.lease.owner)
    assert receipt["charged"] == key


def _mark(what: str, ctx: tokenline.JobContext) -> None:
    """A plain INSERT on a connection of its own, fenced by nothing: the kind of write
    that must never run once the attempt's lease is gone."""
    conn = sqlite3.connect(path_from_url(app.url), timeout=30, isolation_level=None)
    try:
        conn.execute(
            "INSERT INTO effects (key, job_id, token, worker) VALUES (?, ?, ?, ?)",
            (what, ctx.job_id, ctx.token, ctx.lease.owner),
        )
    finally:
        conn.close()


@app.task(name="paused_write", queue="acc", max_attempts=5)
async def paused_write(ctx: tokenline.JobContext, sleep: float, hold: float) -> None:
    """Mark "started", then on the first attempt (token 1) hold the loop for ``hold``
    seconds and await ``sleep`` seconds (later attempts run straight through), then
    mark "after"."""
    _mark("started", ctx)
    if ctx.token == 1 and hold:
        time.sleep(hold)  # noqa: ASYNC251 - a step that holds the loop, as CPU-bound work does
    await asyncio.sleep(sleep if ctx.token == 1 else 0)
    _mark("after", ctx)
