"""A task for the clock-skew acceptance test: a short piece of work, then one business
row written in the job's fenced transaction (PostgreSQL), with the token that wrote it."""

from __future__ import annotations

import asyncio

import tokenline

app = tokenline.App()


@app.task(name="skew.work", queue="skew")
async def work(ctx: tokenline.JobContext, key: str, seconds: float) -> None:
    """Work, then write the row: a second row for a key would be a duplicate effect."""
    await asyncio.sleep(seconds)
    async with ctx.transaction() as conn:
        await conn.execute(
            "INSERT INTO skew_effects (key, token, owner) VALUES (%s, %s, %s)",
            (key, ctx.token, ctx.lease.owner),
        )
