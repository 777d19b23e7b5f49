"""A periodic task every second, and a minimal maintenance leader for it (test-only).

``python periodicapp.py <name>`` runs a leader loop: every ``0.2`` s it takes (or renews)
the maintenance lease, TTL 2 s, and, while it holds it, runs one scheduler pass with
that lease. Several such processes stand by for each other; killing or pausing the
holder hands the schedule to another. (The real maintenance runner replaces this loop.)
"""

from __future__ import annotations

import asyncio
import os
import sys

import tokenline
from tokenline._errors import StoreError
from tokenline.maintenance.scheduler import Scheduler

MAINT = "tokenline:maintenance"
TTL = 2.0
EVERY = 0.2

app = tokenline.App()


@app.periodic(cron="* * * * * *", catch_up="all", queue="acc", name="tick")
def tick(ctx: tokenline.JobContext) -> None:
    """Record this instant's run, atomically with the job's completion."""
    with ctx.transaction() as conn:
        conn.execute(
            "INSERT INTO ticks (key, job_id, token) VALUES (?, ?, ?)",
            (ctx.idempotency_key, ctx.job_id, ctx.token),
        )


async def lead(name: str) -> None:
    """Stand by for, then hold, the maintenance lease and schedule while holding it."""
    owner = f"{name}:{os.getpid()}"
    store = app.open_store()
    await store.open()
    scheduler = Scheduler(store, app, interval=EVERY)
    while True:
        try:
            lease = await store.resource_lease_acquire(resource=MAINT, owner=owner, ttl=TTL)
            if lease is not None:
                report = await scheduler.run_once(leader=lease)
                if report.total or report.refused:
                    print(f"token {lease.token}: {dict(report.counts)} refused={report.refused}")
                    sys.stdout.flush()
        except StoreError as exc:
            print(f"store error: {exc}", flush=True)
        await asyncio.sleep(EVERY)


if __name__ == "__main__":
    asyncio.run(lead(sys.argv[1]))
