"""Sabotage for the control experiments: tokenline with one protection taken out.

Each class puts back a hole that tokenline closes, so a test can show that the
protection is what keeps the invariant — the zombie test, the drill, the lost ack all
fail here. This module lives in the test tree on purpose: nothing under ``src/`` can
reach it, and no setting or environment variable of tokenline turns a protection off.
Worker processes import the apps below (``--app sabotage:…``) with this directory on
``PYTHONPATH``; each one still wraps its store for the drill's faults.

* **state-only stores**: every line of the store's queries that checks a token (the
  lines ending in ``-- fence``) removed — what a queue that only checks ``state =
  'running'`` does; the in-memory store's ``_holds`` checks the state only; the
  PostgreSQL one also leaves a rescued attempt's open transaction alone;
* **split completion**: ``ctx.transaction()`` commits the user's writes without the
  job's completion, which then goes through ``jobs_finish`` in a second commit — the
  effect and its ack apart, as in a queue without transactional completion;
* **worker clock**: the worker's own wall clock handed to its store, as tokenline once
  did;
* **markless stores**: a periodic schedule's high-water mark no longer refuses an
  instant at or before it (the lines of ``schedule_advance``, or of Redis's
  ``schedule.lua``, ending in ``-- mark`` removed), so only the unique key — released
  once the job finishes — stands between a finished instant and its second run.
* **leaderless stores**: maintenance writes without the leader check (``leader_holds``
  always answers yes; the in-memory store skips it): a deposed leader's rescue or
  repair is applied, as in a queue that uses its maintenance lease only as "do I have
  it".
* **a ledger that trusts token numbers** (split topology): the owner check of the
  ledger's job fence removed, so an equal token from another owner — the number a
  promoted Redis replica hands out again — is accepted.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from typing import Any

from tokenline import App
from tokenline._jobs import JobState, Lease
from tokenline.drill import app as drill
from tokenline.drill.faultstore import wrap_from_env
from tokenline.stores import MemoryStore, Store, store_from_url
from tokenline.stores.sqlite import SQLiteStore

#: The queries whose token checks the state-only stores remove.
FENCED_QUERIES = ("finish", "fence_check", "transaction_begin", "job_leases_renew")
#: PostgreSQL's effect_take checks the token itself too (effect_begin in one statement).
POSTGRES_FENCED_QUERIES = (*FENCED_QUERIES, "effect_take")


def without_fences(text: str) -> str:
    """``text`` without its lines that end in ``-- fence`` (there must be some)."""
    lines = text.splitlines()
    kept = [line for line in lines if not line.rstrip().endswith("-- fence")]
    if len(kept) == len(lines):
        raise ValueError("a fenced query has no line ending in '-- fence'")
    return "\n".join(kept)


def number_trusting_ledger(ledger: Any) -> None:
    """Make a split store's ledger accept an equal token from any owner: the owner check
    of its job fence (the ``-- fence`` lines of ``fence_check`` / ``transaction_begin``)
    is removed from its queries, in place."""
    for name in ("fence_check", "transaction_begin"):
        ledger._queries[name] = without_fences(ledger._queries[name])


class StateOnlyMemoryStore(MemoryStore):
    """The in-memory store, checking that a job runs but not who holds it."""

    def _holds(self, lease: Lease) -> bool:
        job = self._jobs.get(lease.job_id)
        return job is not None and job.state is JobState.RUNNING


class StateOnlySQLiteStore(SQLiteStore):
    """The SQLite store without its token checks."""

    def _q(self, name: str) -> str:
        text = super()._q(name)
        return without_fences(text) if name in FENCED_QUERIES else text


class LeaderlessMemoryStore(MemoryStore):
    """The in-memory store, applying maintenance writes of any leader, deposed or not."""

    def _check_leader(self, leader: Any, operation: str, now: float) -> None:
        return None


class LeaderlessSQLiteStore(SQLiteStore):
    """The SQLite store without its leader check on maintenance writes."""

    def _q(self, name: str) -> str:
        return "SELECT 1" if name == "leader_holds" else super()._q(name)


def leaderless_postgres(url: str, **kwargs: Any) -> Store:
    """A PostgreSQL store without its leader check (psycopg imported only here)."""
    from tokenline.stores.postgres import PostgresStore

    class LeaderlessPostgresStore(PostgresStore):
        """The PostgreSQL store without its leader check on maintenance writes."""

        def _q(self, name: str) -> str:
            return "SELECT 1" if name == "leader_holds" else super()._q(name)

    return LeaderlessPostgresStore(url, **kwargs)


def state_only_postgres(url: str, **kwargs: Any) -> Store:
    """A PostgreSQL store without its token checks (psycopg imported only here)."""
    return _state_only_postgres(url, **kwargs)


def _state_only_postgres(url: str, **kwargs: Any) -> Store:
    from tokenline.stores.postgres import PostgresStore

    class StateOnlyPostgresStore(PostgresStore):
        """The PostgreSQL store without its token checks."""

        def _q(self, name: str) -> str:
            text = super()._q(name)
            return without_fences(text) if name in POSTGRES_FENCED_QUERIES else text

        async def _end_sessions(self, sessions: list[str]) -> None:
            # A state-only queue leaves a rescued attempt's transaction open, too.
            return None

    return StateOnlyPostgresStore(url, **kwargs)


def _split(store: Store) -> Store:
    """``store`` with its fenced transactions committing without the completion."""
    make = store.fenced_transaction

    def fenced_transaction(**kwargs: Any) -> Any:
        transaction = make(**kwargs)

        def complete(conn: Any) -> bool:
            return False

        def complete_steps() -> Generator[Any, Any, bool]:
            # The job is not finished in the transaction; the block's guard is closed as
            # the real completion closes it (migration 0014), or the commit is refused.
            from tokenline.stores.postgres._steps import fetch_one

            yield from fetch_one(transaction._store._q("transaction_block_close"))
            return False

        # The user's writes commit; the job is finished later, apart. PostgreSQL's
        # _complete is steps (see stores/postgres/_steps.py), run by `with` and
        # `async with` alike; SQLite's a plain method on its connection.
        as_steps = inspect.isgeneratorfunction(type(transaction)._complete)  # type: ignore[attr-defined]
        transaction._complete = complete_steps if as_steps else complete  # type: ignore[attr-defined]
        return transaction

    store.fenced_transaction = fenced_transaction  # type: ignore[method-assign]
    return store


class SabotagedApp(App):
    """An app whose stores have the sabotage named by ``state_only`` and ``split``."""

    def __init__(self, *, state_only: bool = False, split: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state_only = state_only
        self.split = split

    def open_store(self, *, timeout: float | None = None) -> Store:
        options: dict[str, Any] = {"timeout": timeout or self.settings.store_timeout}
        store: Store
        if not self.state_only:
            store = super().open_store(timeout=timeout)
        elif self.url.startswith("sqlite:"):
            store = StateOnlySQLiteStore(self.url, **options)
        elif self.url.startswith("memory:"):
            store = super().open_store(timeout=timeout)
        else:
            store = _state_only_postgres(self.url, migrate=self.settings.migrate, **options)
        if self.split:
            store = _split(store)
        return wrap_from_env(store)


class WorkerClockApp(App):
    """Hands the worker's own wall clock to its store, as tokenline once did: lease
    expiry, claim eligibility and rescue then follow each worker's clock, so a worker
    whose clock runs ahead rescues live leases and one behind never claims a job."""

    def open_store(self, *, timeout: float | None = None) -> Store:
        return wrap_from_env(
            store_from_url(
                self.url,
                clock=self.clock,
                timeout=timeout or self.settings.store_timeout,
                migrate=self.settings.migrate,
            )
        )


def with_drill_tasks(app: App) -> App:
    """``app`` with the drill's tasks registered."""
    for task in drill.app.tasks.values():
        app.task(name=task.name, queue=task.queue, max_attempts=task.max_attempts)(task.fn)
    return app


#: The drill's app without token checks (the sigstop control).
unfenced = with_drill_tasks(SabotagedApp(state_only=True))
#: The drill's app without token checks and with the completion split from the effect
#: (the lost_ack control).
split = with_drill_tasks(SabotagedApp(state_only=True, split=True))
#: The drill's app with the worker's clock in the store (the clock_skew control).
worker_clock = with_drill_tasks(WorkerClockApp(clock=drill.app.clock))


# -- periodic jobs: the schedule's high-water mark check taken out ---------------------------
def without_mark(text: str) -> str:
    """``text`` without its lines that end in ``-- mark`` (there must be some)."""
    lines = text.splitlines()
    kept = [line for line in lines if not line.rstrip().endswith("-- mark")]
    if len(kept) == len(lines):
        raise ValueError("the schedule query has no line ending in '-- mark'")
    return "\n".join(kept)


class MarklessMemoryStore(MemoryStore):
    """The in-memory store enqueuing every instant it is given, whatever the mark."""

    async def schedule_advance(
        self, *, leader: Any, schedule: str, instant: float, job: Any
    ) -> bool:
        with self._lock:
            self._check_leader(leader, "schedule", self.clock.now())
            self._marks[schedule] = max(instant, self._marks.get(schedule, instant))
        if job is not None:
            await self.jobs_enqueue(jobs=[job])
        return True


class MarklessSQLiteStore(SQLiteStore):
    """The SQLite store whose schedule mark moves, and lets the job in, every time."""

    def _q(self, name: str) -> str:
        text = super()._q(name)
        return without_mark(text) if name == "schedule_advance" else text


def markless_postgres(url: str, **kwargs: Any) -> Store:
    """A PostgreSQL store whose schedule mark never refuses an instant."""
    from tokenline.stores.postgres import PostgresStore

    class MarklessPostgresStore(PostgresStore):
        def _q(self, name: str) -> str:
            text = super()._q(name)
            return without_mark(text) if name == "schedule_advance" else text

    return MarklessPostgresStore(url, **kwargs)


def markless_redis(url: str, **kwargs: Any) -> Any:
    """A Redis store (the split topology's broker) whose schedule script moves the mark,
    and lets the job in, every time."""
    from tokenline.stores.redis import RedisStore
    from tokenline.stores.redis.store import _TEXT

    class MarklessRedisStore(RedisStore):
        async def connect(self) -> None:
            await super().connect()
            script = without_mark(_TEXT["schedule"])
            self._scripts["schedule"] = self._redis().register_script(script)

    return MarklessRedisStore(url, **kwargs)
