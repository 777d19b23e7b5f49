"""One sync and one async handler, written once, for every store.

Each ships an order: runs an external effect once per order (``ctx.effect``), takes the
order's account lease (``ctx.lease``), records the lease's token as the highest that
wrote the account (``ctx.fenced``), then writes the shipment row in the job's fenced
transaction, in the store's own parameter style (``ctx.placeholder``).
"""

from __future__ import annotations

from typing import Any

import tokenline

#: Created once per store by the tests; the handlers only insert.
SHIPMENTS = "CREATE TABLE shipments (order_id bigint, token bigint, lease_token bigint, kind text)"


def _insert(ctx: tokenline.JobContext, order_id: int, lease_token: int, kind: str) -> Any:
    p = ctx.placeholder
    sql = f"INSERT INTO shipments (order_id, token, lease_token, kind) VALUES ({p}, {p}, {p}, {p})"
    return sql, (order_id, ctx.token, lease_token, kind)


def register(app: tokenline.App) -> None:
    """Add the two tasks to ``app``."""

    @app.task(name="ship", queue="ship")
    def ship(ctx: tokenline.JobContext, order_id: int) -> None:
        label = ctx.effect(f"label:{order_id}", lambda: {"label": f"L-{order_id}"})
        assert label == {"label": f"L-{order_id}"}
        with ctx.lease(f"account:{order_id}") as lease:
            assert ctx.fenced(f"account:{order_id}") == lease.token
            with ctx.transaction() as conn:
                conn.execute(*_insert(ctx, order_id, lease.token, "sync"))

    @app.task(name="ship_async", queue="ship")
    async def ship_async(ctx: tokenline.JobContext, order_id: int) -> None:
        async def make_label() -> dict[str, str]:
            return {"label": f"L-{order_id}"}

        label = await ctx.effect(f"label:{order_id}", make_label)
        assert label == {"label": f"L-{order_id}"}
        async with ctx.lease(f"account:{order_id}") as lease:
            assert await ctx.fenced(f"account:{order_id}") == lease.token
            async with ctx.transaction() as conn:
                result = conn.execute(*_insert(ctx, order_id, lease.token, "async"))
                if hasattr(result, "__await__"):  # psycopg's async connection
                    await result
