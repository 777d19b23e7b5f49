"""A periodic task every second, run by the workers' maintenance leader (test-only).

Every worker of this app stands for maintenance leadership; the leader's scheduler
enqueues each second's instant once (tokenline.maintenance.scheduler).
"""

from __future__ import annotations

import tokenline

app = tokenline.App()


@app.periodic(cron="* * * * * *", catch_up="all", queue="acc", name="tick")
def tick(ctx: tokenline.JobContext) -> None:
    """Record this instant's run, atomically with the job's completion."""
    with ctx.transaction() as conn:
        conn.execute(
            "INSERT INTO ticks (key, job_id, token) VALUES (?, ?, ?)",
            (ctx.idempotency_key, ctx.job_id, ctx.token),
        )
