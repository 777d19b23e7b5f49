"""The demo application: invoices, each written exactly once through ``ctx.transaction``.

Worker processes import ``tokenline.demo:app``; the store URL comes from
``TOKENLINE_URL``, which ``tokenline demo`` sets for them. One handler serves every
store: ``with ctx.transaction()`` hands it the store's own connection, and
``ctx.placeholder`` its parameter marker. The invoice table is named by
``TOKENLINE_DEMO_TABLE``.
"""

from __future__ import annotations

import os
import random
import re
import time

from ._app import App
from ._errors import ConfigError, Retry
from .worker.context import JobContext

__all__ = ["app", "invoice", "invoice_table"]

app = App()

_TABLE_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}(\.[a-z_][a-z0-9_]{0,62})?$")

#: Columns of the invoice table. No unique constraint on purpose: a duplicate effect
#: would show up as a second row.
COLUMNS = "order_id, amount_cents, job_id, token, worker"


def invoice_table() -> str:
    """The invoice table's name, checked: it is put into SQL text."""
    name = os.environ.get("TOKENLINE_DEMO_TABLE", "demo_invoices")
    if not _TABLE_RE.match(name):
        raise ConfigError("TOKENLINE_DEMO_TABLE", f"not a plain table name: {name!r}")
    return name


def _flaky(ctx: JobContext, order_id: int) -> None:
    if order_id % 97 == 0 and ctx.token == 1:
        # A flaky payment gateway: the first try of a few orders fails transiently.
        raise Retry(delay=0.2, reason="payment gateway timed out")


@app.task(name="demo.invoice", queue="invoices", max_attempts=5)
def invoice(ctx: JobContext, order_id: int, amount_cents: int) -> None:
    """Render an invoice (simulated work), then write it in the job's fenced transaction."""
    time.sleep(random.uniform(0.01, 0.04))
    _flaky(ctx, order_id)
    ctx.check()
    marks = ", ".join([ctx.placeholder] * 5)
    insert = f"INSERT INTO {invoice_table()} ({COLUMNS}) VALUES ({marks})"
    with ctx.transaction() as conn:
        conn.execute(insert, (order_id, amount_cents, ctx.job_id, ctx.token, ctx.lease.owner))
