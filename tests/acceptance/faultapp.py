"""Tasks driven by the acceptance tests through the real CLI."""

from __future__ import annotations

import time

import tokenline

app = tokenline.App()


@app.task(name="slow_effect", queue="acc", max_attempts=5)
def slow_effect(
    ctx: tokenline.JobContext, key: str, first_sleep: float, later_sleep: float
) -> None:
    """Sleep (long on the first attempt), then write one effect row, fenced."""
    time.sleep(first_sleep if ctx.attempt == 1 else later_sleep)
    with ctx.transaction() as conn:
        conn.execute(
            "INSERT INTO effects (key, job_id, token, worker) VALUES (?, ?, ?, ?)",
            (key, ctx.job_id, ctx.token, ctx.lease.owner),
        )
