"""The drill's application: each job writes one business row through ``ctx.transaction``.

Worker processes import ``tokenline.drill.app:app``; the drill runner sets
``TOKENLINE_URL`` and names the business table in ``TOKENLINE_DRILL_TABLE``. One
handler serves every store (``async with ctx.transaction()``, ``ctx.placeholder``). The row
carries the job's key and the token of the attempt that wrote it, so the invariant
checker can count duplicate effects by key and spot a write by a stale token.

Work time is part of the job's arguments (the runner draws it from the seed); a re-run
(token > 1) works ``rerun_extra`` seconds longer, so a zombie that wakes up while the
new owner is still working finds the job *running* under a newer token — the moment
only a token check, not a state check, can refuse its commit. ``hold_ms`` keeps the
transaction open that long after the write (the ``long_transaction`` scenario).

``TOKENLINE_DRILL_CLOCK_OFFSET`` (seconds) shifts this worker's wall clock, as a worker
on a machine whose clock is wrong (the ``clock_skew`` scenario). Nothing the store
decides reads it, which is what the scenario checks.

The ``slow_dependency`` scenario's jobs (``drill.call``) call the drill's dependency
(:mod:`tokenline.drill.dependency`) first, then do the same work. Their workers run
one of two apps of their own: :data:`guarded` registers the dependency and its circuit
breaker, and its task ``depends_on`` it and calls it through ``ctx.dependency``;
:data:`unguarded` calls it with the same timeout and no breaker, for comparison. The
other scenarios' app, :data:`app`, knows no dependency, so its workers keep no breaker
and read no breaker's state from the store.

The periodic scenarios' workers run :data:`periodic`: the same ``drill.work`` and a
periodic task, ``drill.tick``, every second (``catch_up="all"``), enqueued by the
maintenance leader. Each instant's job writes its business row like any drill job, keyed
by the instant's idempotency key, so an instant run twice is a duplicate effect.

Its stores take the faults the drill switches on: :class:`DrillApp` wraps them with
:func:`~tokenline.drill.faultstore.wrap_from_env`. Only these apps do.

The four apps are built on first use (a module ``__getattr__``), not at import: an app
reads the ``TOKENLINE_*`` environment, and the command line imports this module for
every command, ``--help`` included. A bad variable is reported by what uses an app.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import os
import re

from .._app import App
from .._clock import SystemClock
from .._errors import ConfigError
from ..stores.base import Store
from ..worker.context import JobContext
from . import dependency
from .faultstore import wrap_from_env

__all__ = [
    "CALL_TASK",
    "CLOCK_OFFSET_ENV",
    "COLUMNS",
    "GUARDED",
    "PERIODIC",
    "QUEUE",
    "TABLE_ENV",
    "TICK_CRON",
    "TICK_TASK",
    "UNGUARDED",
    "DrillApp",
    "ShiftedClock",
    "app",
    "business_table",
    "call_guarded",
    "call_unguarded",
    "guarded",
    "periodic",
    "tick",
    "unguarded",
    "work",
]

CLOCK_OFFSET_ENV = "TOKENLINE_DRILL_CLOCK_OFFSET"


class ShiftedClock(SystemClock):
    """This machine's clocks, the wall clock shifted by ``offset`` seconds."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def now(self) -> float:
        """The wall clock, wrong by ``offset``."""
        return super().now() + self.offset


def _clock() -> SystemClock:
    raw = os.environ.get(CLOCK_OFFSET_ENV)
    if not raw:
        return SystemClock()
    try:
        offset = float(raw)
    except ValueError:
        offset = math.nan
    if not math.isfinite(offset):
        raise ConfigError(CLOCK_OFFSET_ENV, f"must be a number of seconds, got {raw!r}")
    return ShiftedClock(offset)


class DrillApp(App):
    """An app whose stores take the drill's faults (see the module docstring)."""

    def open_store(self, *, timeout: float | None = None) -> Store:
        """The app's store, wrapped for the faults the drill switches on."""
        return wrap_from_env(super().open_store(timeout=timeout))


QUEUE = "drill"
TABLE_ENV = "TOKENLINE_DRILL_TABLE"
#: No unique constraint on purpose: a duplicate effect must show up as a second row.
COLUMNS = "job_key TEXT NOT NULL, job_id BIGINT NOT NULL, token BIGINT NOT NULL, worker TEXT"

_TABLE_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}(\.[a-z_][a-z0-9_]{0,62})?$")


def business_table() -> str:
    """The business table's name, checked: it is put into SQL text."""
    name = os.environ.get(TABLE_ENV, "drill_effects")
    if not _TABLE_RE.match(name):
        raise ConfigError(TABLE_ENV, f"not a plain table name: {name!r}")
    return name


def _seconds(ctx: JobContext, work_ms: float, rerun_extra: float) -> float:
    # A re-run is a job's second token or later. On the split topology a token carries
    # the Redis epoch in its high bits (EPOCH_SHIFT): the count is in the low ones.
    return work_ms / 1000 + (rerun_extra if ctx.token % 2**32 > 1 else 0.0)


async def work(
    ctx: JobContext, key: str, work_ms: float, rerun_extra: float = 0.0, hold_ms: float = 0.0
) -> None:
    """Work for a while, then write the job's business row in its fenced transaction
    (kept open ``hold_ms`` after the write)."""
    await asyncio.sleep(_seconds(ctx, work_ms, rerun_extra))
    marks = ", ".join([ctx.placeholder] * 4)
    insert = f"INSERT INTO {business_table()} VALUES ({marks})"
    async with ctx.transaction() as conn:
        done = conn.execute(insert, (key, ctx.job_id, ctx.token, ctx.lease.owner))
        if inspect.isawaitable(done):  # the async driver's (PostgreSQL)
            await done
        await asyncio.sleep(hold_ms / 1000)


# -- the slow_dependency scenario's jobs ----------------------------------------------------
CALL_TASK = "drill.call"
#: The workers' apps (``--app``) of the jobs that call the dependency: with its breaker,
#: and without.
GUARDED = "tokenline.drill.app:guarded"
UNGUARDED = "tokenline.drill.app:unguarded"


async def call_guarded(ctx: JobContext, key: str, work_ms: float) -> None:
    """Call the dependency through its circuit breaker, then work as ``drill.work``."""
    async with ctx.dependency(dependency.NAME):
        await dependency.Stub.from_env().call()
    await work(ctx, key, work_ms)


async def call_unguarded(ctx: JobContext, key: str, work_ms: float) -> None:
    """Call the dependency with the same timeout and no breaker, then work."""
    try:
        async with asyncio.timeout(dependency.TIMEOUT):
            await dependency.Stub.from_env().call()
    except TimeoutError as exc:
        # Worded as ctx.dependency words it: the drill counts attempts by this name.
        raise TimeoutError(
            f"dependency {dependency.NAME!r} did not answer within {dependency.TIMEOUT:g}s"
        ) from exc
    await work(ctx, key, work_ms)


# -- the periodic scenarios' app -------------------------------------------------------------
#: The workers' app of the periodic scenarios.
PERIODIC = "tokenline.drill.app:periodic"
#: The periodic task (and its schedule's name).
TICK_TASK = "drill.tick"
#: Every second (six fields, seconds last).
TICK_CRON = "* * * * * *"
#: How long an instant's job works before its write.
_TICK_MS = 5.0


async def tick(ctx: JobContext) -> None:
    """Write this instant's business row, keyed by the instant's idempotency key, as
    ``drill.work`` writes a job's."""
    key = ctx.idempotency_key
    if key is None:  # only the scheduler enqueues this task, always with the key
        raise ValueError(f"{TICK_TASK} runs as an instant's job, with the instant's key")
    await work(ctx, key, _TICK_MS)


# -- the apps, built on first use ----------------------------------------------------------
_APP_NAMES = ("app", "guarded", "unguarded", "periodic")
#: The other scenarios' workers' app: the drill's jobs (``drill.work``).
app: DrillApp
#: The drill's dependency behind its circuit breaker.
guarded: DrillApp
#: The same calls without a breaker.
unguarded: DrillApp
#: The drill's jobs and a periodic task every second, with catch-up of every instant.
periodic: DrillApp


@functools.cache
def _apps() -> dict[str, DrillApp]:
    clock = _clock()
    # The drill's jobs (``drill.work``), the other scenarios' workers' app.
    app = DrillApp(clock=clock)
    app.task(name="drill.work", queue=QUEUE, max_attempts=25)(work)
    # The drill's dependency behind its circuit breaker.
    guarded = DrillApp(clock=clock)
    guarded.dependency(dependency.NAME, **dependency.BREAKER)
    guarded.task(name=CALL_TASK, queue=QUEUE, max_attempts=25, depends_on=[dependency.NAME])(
        call_guarded
    )
    # The same calls without a breaker.
    unguarded = DrillApp(clock=clock)
    unguarded.task(name=CALL_TASK, queue=QUEUE, max_attempts=25)(call_unguarded)
    # The drill's jobs and a periodic task every second, with catch-up of every instant.
    periodic = DrillApp(clock=clock)
    periodic.task(name="drill.work", queue=QUEUE, max_attempts=25)(work)
    periodic.task(name=TICK_TASK, queue=QUEUE, max_attempts=25)(tick)
    periodic.periodic(cron=TICK_CRON, catch_up="all", queue=QUEUE, name=TICK_TASK)(tick)
    return {"app": app, "guarded": guarded, "unguarded": unguarded, "periodic": periodic}


def __getattr__(name: str) -> DrillApp:
    """``app``, ``guarded``, ``unguarded`` and ``periodic``, built on first use (see the
    module docstring)."""
    apps = _apps() if name in _APP_NAMES else {}
    try:
        return apps[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
