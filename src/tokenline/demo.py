"""The demo application: invoices, each written exactly once through ``ctx.transaction``.

Worker processes import ``tokenline.demo:app``; the store URL comes from
``TOKENLINE_URL``, which ``tokenline demo`` sets for them.
"""

from __future__ import annotations

import random
import sqlite3
import time

from ._app import App
from ._errors import Retry
from .worker.context import JobContext

__all__ = ["INVOICE_TABLE", "app", "create_tables", "invoice"]

app = App()

#: No unique constraint on purpose: a duplicate effect would show up as a second row.
INVOICE_TABLE = """
CREATE TABLE IF NOT EXISTS demo_invoices (
    order_id     INTEGER NOT NULL,
    amount_cents INTEGER NOT NULL,
    job_id       INTEGER NOT NULL,
    token        INTEGER NOT NULL,
    worker       TEXT    NOT NULL
)
"""


def create_tables(conn: sqlite3.Connection) -> None:
    """Create the demo's business table."""
    conn.execute(INVOICE_TABLE)


@app.task(name="demo.invoice", queue="invoices", max_attempts=5)
def invoice(ctx: JobContext, order_id: int, amount_cents: int) -> None:
    """Render an invoice (simulated work), then write it in the job's fenced transaction."""
    time.sleep(random.uniform(0.01, 0.04))
    if order_id % 97 == 0 and ctx.attempt == 1:
        # A flaky payment gateway: the first try of a few orders fails transiently.
        raise Retry(delay=0.2, reason="payment gateway timed out")
    ctx.check()
    with ctx.transaction() as conn:
        conn.execute(
            "INSERT INTO demo_invoices (order_id, amount_cents, job_id, token, worker) "
            "VALUES (?, ?, ?, ?, ?)",
            (order_id, amount_cents, ctx.job_id, ctx.token, ctx.lease.owner),
        )
