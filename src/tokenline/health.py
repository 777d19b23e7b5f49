"""The store's health as operators see it, for the command line and the dashboard:
each channel probed on its own, worker memberships judged alive by the store's clock,
and whether a lease's holder is who an operator names.

Each channel (DESIGN.md's three roles) is probed on its own, with its own deadline, and
a failing one says how it fails:

* **unreachable**: no connection, or the store said it is unavailable;
* **slow**: no answer within the caller's timeout (or the store's own statement timeout);
* **refusing**: the store answered, with an error (a missing privilege, say, or a
  PostgreSQL that accepts no writes: a standby, a read-only role);
* **not migrated**: the store answers but its schema is not installed, or is older;
* **schema too new**: the store answers but its schema was written by a newer
  tokenline (upgrade tokenline; migrating cannot help).

When the store cannot even be opened, every channel fails the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from ._errors import SchemaVersionError, StoreError, StoreUnavailableError
from ._jobs import WorkerRecord
from .dependencies import SharedBreaker, read_shared
from .drill.storefaults import InjectedFaultError
from .stores import Store
from .stores.base import ResourceLease

__all__ = [
    "CHANNELS",
    "FAILURES",
    "alive",
    "failure_kind",
    "lease_mismatch",
    "live",
    "read_status",
    "worker_state",
]

T = TypeVar("T")

#: What each channel of the store carries (DESIGN.md's three roles).
CHANNELS = {
    "broker": "the queue: enqueue, claim, finish",
    "leases": "job ownership: lease renewal, workers, the store's clock",
    "ledger": "effects and fenced writes",
}

UNREACHABLE, SLOW, REFUSING = "unreachable", "slow", "refusing"
NOT_MIGRATED, TOO_NEW = "not migrated", "schema too new"
#: The ways a channel fails, as status names them.
FAILURES = (UNREACHABLE, SLOW, REFUSING, NOT_MIGRATED, TOO_NEW)

# How the stores word a schema written by a newer tokenline (their SchemaVersionError
# says older and newer alike): the remedy is the opposite of a migration.
_NEWER_SCHEMA = "newer than this tokenline"

#: How long a probe given up on may take to end before status goes on without it.
_GRACE = 1.0

# The drivers' own codes, read from the cause the store kept when it translated the
# error: the exception tree says "unavailable" for both a refused connection and a
# missing privilege, which an operator fixes in different places.
_SLOW_SQLSTATES = frozenset({"57014"})  # query_canceled: statement_timeout
# A server that takes no writes (a standby, a read-only role) answers, and refuses.
_REFUSED_SQLSTATES = frozenset({"42501", "28000", "28P01", "25006"})
_UNMIGRATED_SQLSTATES = frozenset({"3F000", "42P01", "42883"})  # no schema, table, function
_REFUSED_SQLITE = frozenset({sqlite3.SQLITE_PERM, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_AUTH})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from, innermost last."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _cause_kind(exc: BaseException) -> str | None:
    sqlstate = getattr(exc, "sqlstate", None)
    code = getattr(exc, "sqlite_errorcode", None)
    hung = isinstance(exc, InjectedFaultError) and exc.kind == "hang"
    if hung or isinstance(exc, TimeoutError) or sqlstate in _SLOW_SQLSTATES:
        return SLOW
    if sqlstate in _UNMIGRATED_SQLSTATES:
        return NOT_MIGRATED
    if isinstance(exc, PermissionError) or sqlstate in _REFUSED_SQLSTATES:
        return REFUSING
    if isinstance(code, int) and code & 0xFF in _REFUSED_SQLITE:
        return REFUSING
    return None


def failure_kind(exc: BaseException) -> str:
    """How a store call failed, one of :data:`FAILURES`."""
    for e in _chain(exc):
        if isinstance(e, SchemaVersionError):
            return TOO_NEW if _NEWER_SCHEMA in str(e) else NOT_MIGRATED
        kind = _cause_kind(e)
        if kind is not None:
            return kind
    return UNREACHABLE if isinstance(exc, StoreUnavailableError) else REFUSING


async def _bounded(coro: Coroutine[Any, Any, T], timeout: float) -> T:  # noqa: ASYNC109
    """``coro``'s result, or :class:`TimeoutError` after ``timeout`` seconds; a call
    given up on gets a moment to end, never as long as it likes."""
    task = asyncio.ensure_future(coro)
    # Whoever gives up on the call (the timeout below, a Ctrl-C cancelling this
    # coroutine) leaves the task to end alone: its error is read here, or Python
    # reports it as never retrieved when the task is collected.
    task.add_done_callback(_read_outcome)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()  # asyncio.wait does not cancel what it waits for
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=_GRACE)
        raise TimeoutError(f"no answer within {timeout:g}s")
    return task.result()


def _read_outcome(task: asyncio.Future[Any]) -> None:
    """Mark a finished task's error as seen (see :func:`_bounded`)."""
    if not task.cancelled():
        task.exception()


class _Probe:
    """One channel's answer: how long it took, and how it failed if it did."""

    def __init__(self) -> None:
        self.latency: float | None = None
        self.failure: str | None = None
        self.error: str | None = None

    def failed(self, exc: BaseException) -> None:
        self.failure = failure_kind(exc)
        self.error = str(exc) or type(exc).__name__

    async def run(
        self,
        call: Callable[[], Coroutine[Any, Any, T]],
        timeout: float,  # noqa: ASYNC109
        *,
        skip: bool = False,
    ) -> T | None:
        if skip:
            return None
        started = time.monotonic()
        try:
            return await _bounded(call(), timeout)
        except (StoreError, TimeoutError) as exc:
            self.failed(exc)
            return None
        finally:
            self.latency = time.monotonic() - started

    def json(self) -> dict[str, Any]:
        return {
            "ok": self.error is None,
            "failure": self.failure,
            "latency_ms": None if self.latency is None else round(self.latency * 1000, 3),
            "error": self.error,
        }


def _missing_sqlite_file(store: Store) -> str | None:
    """The path of a SQLite store's file when it does not exist in a directory that
    does (opening would create it, and an empty store at a mistyped path would look
    healthy). A missing directory is left to ``open``: the store is unreachable."""
    from .stores.sqlite import SQLiteStore

    inner = getattr(store, "inner", store)  # a store wrapped for faults
    if isinstance(inner, SQLiteStore) and inner.path.parent.is_dir() and not inner.path.exists():
        return str(inner.path)
    return None


async def _missing_schema(store: Store, timeout: float) -> str | None:  # noqa: ASYNC109
    """What a store lacks to exist (its PostgreSQL schema, tokenline's tables in a
    SQLite file), asked without creating it: opening would install it, and a mistyped
    name would look healthy and empty. ``None`` when it is there, or when the server
    refuses the question (opening then says why). A server that does not answer raises
    (:class:`StoreUnavailableError`, :class:`TimeoutError`): opening would wait as long
    again to say the same."""
    from .stores.sqlite import SQLiteStore

    inner = getattr(store, "inner", store)  # a store wrapped for faults
    missing = getattr(inner, "missing", None)
    if missing is None or (isinstance(inner, SQLiteStore) and not inner.path.is_file()):
        return None  # no file: _missing_sqlite_file, or a missing directory for open
    try:
        found: str | None = await _bounded(missing(), timeout)
    except StoreUnavailableError:
        raise
    except StoreError:
        return None
    return found


#: The store's verdict when opening it failed in this way.
_STORE_STATE = {
    UNREACHABLE: "unreachable",
    SLOW: "slow",
    REFUSING: "refusing",
    NOT_MIGRATED: "schema not ready",
    TOO_NEW: "schema not ready",
}


#: The ledger channel of a store without one.
_NOT_PROVIDED: dict[str, Any] = {"ok": None, "failure": None, "latency_ms": None, "error": None}


def _failing(kind: str, error: str) -> dict[str, Any]:
    """One channel failing in this way."""
    return {"ok": False, "failure": kind, "latency_ms": None, "error": error}


def _all_failing(store: Store, kind: str, error: str) -> dict[str, Any]:
    """Every channel failing as the store did."""
    channels = {name: _failing(kind, error) for name in CHANNELS}
    if not store.capabilities.ledger:
        channels["ledger"] = dict(_NOT_PROVIDED)
    return channels


async def _open(store: Store, timeout: float) -> dict[str, Any] | None:  # noqa: ASYNC109
    """Open ``store``; ``None`` when it opened, else the report of how it failed."""
    missing = _missing_sqlite_file(store)
    if missing is not None:
        error = (
            f"there is no store file at {missing!r}: check the URL (a worker, an enqueue "
            "or `tokenline migrate` creates it)"
        )
        return {
            "store": "missing",
            "error": error,
            "channels": _all_failing(store, NOT_MIGRATED, error),
        }
    by_role = getattr(getattr(store, "inner", store), "open_within", None)
    ledger_down: Exception | None = None
    try:
        absent = await _missing_schema(store, timeout)
    except (StoreUnavailableError, TimeoutError) as unanswered:
        if by_role is None:
            return _open_failed(store, unanswered)
        # The split topology: the ledger did not answer; opening it would wait as long
        # again to say so. Redis's roles are opened, and said, on their own.
        absent, ledger_down = None, unanswered
    if absent is not None:
        error = f"{absent}: run `tokenline migrate` (status created nothing)"
        channels = _all_failing(store, NOT_MIGRATED, error)
        if by_role is not None:
            # The roles on other servers (the split topology's Redis) are probed all
            # the same: one that is down says so, not that it needs a migration.
            try:
                await by_role(timeout, ledger=False)
            finally:
                await _close(store, timeout)
            for name, exc in _roles_down(store).items():
                if name != "ledger":
                    channels[name] = _failing(failure_kind(exc), str(exc) or type(exc).__name__)
            _name_servers(store, channels)
        return {"store": "schema not ready", "error": error, "channels": channels}
    if by_role is not None:
        # A store whose roles live on different servers (the split topology) opens
        # each on its own: the roles that failed are said, the others probed.
        await by_role(timeout, ledger=ledger_down is None)
        if ledger_down is not None:
            inner: Any = getattr(store, "inner", store)
            roles_down: dict[str, Exception] = inner.roles_down
            roles_down["ledger"] = ledger_down
        return None
    try:
        await _bounded(store.open(), timeout)
    except (StoreError, TimeoutError) as exc:
        return _open_failed(store, exc)
    return None


def _open_failed(store: Store, exc: BaseException) -> dict[str, Any]:
    """The report of a store that could not be opened (or asked about) because of ``exc``."""
    kind = failure_kind(exc)
    error = str(exc) or type(exc).__name__
    return {
        "store": _STORE_STATE[kind],
        "error": error,
        "channels": _all_failing(store, kind, error),
    }


def _roles_down(store: Store) -> dict[str, Exception]:
    """The roles a split store could not open (kept by its last open), else none."""
    failed = getattr(getattr(store, "inner", store), "roles_down", None)
    return dict(failed) if isinstance(failed, dict) else {}


def _name_servers(store: Store, channels: dict[str, Any]) -> None:
    """On a store whose roles live on different servers, make each failing channel's
    error name its server (Redis or PostgreSQL) when it does not already."""
    server = getattr(getattr(store, "inner", store), "server", None)
    if server is None:
        return
    for name, channel in channels.items():
        error = channel.get("error")
        if channel.get("ok") is False and error:
            where = str(server(name))
            if where.split(" ")[0] not in error:
                channel["error"] = f"{error} ({where})"


async def _close(store: Store, timeout: float) -> None:  # noqa: ASYNC109
    # Best effort: what status had to say is said; a store that will not close is not news.
    with contextlib.suppress(StoreError, TimeoutError):
        await _bounded(store.close(), timeout)


async def read_status(
    store: Store,
    timeout: float,  # noqa: ASYNC109
    dependencies: Sequence[str] = (),
) -> dict[str, Any]:
    """Open ``store`` and probe its channels at once, each within ``timeout`` seconds;
    what failed, and how, is said, not raised. ``dependencies``: names whose shared
    circuit breakers to read with the leases channel.

    The report's data is ``None`` where the channel carrying it failed (or the store
    did not open), never empty: ``queues`` and ``stale_commits`` (broker), ``now``,
    ``workers`` and, when asked for, ``dependencies`` (leases)."""
    began = time.monotonic()
    failed = await _open(store, timeout)
    if failed is not None:
        return failed | _unknown_data(dependencies)
    down = _roles_down(store)
    probes = {name: _Probe() for name in CHANNELS}
    # One --timeout for the command, not one per step: the probes get what the open
    # left, and at least a second (or the whole timeout, if shorter) to answer in.
    left = max(timeout - (time.monotonic() - began), min(timeout, 1.0))

    async def broker() -> tuple[Any, Any]:
        # Reads pass while writes queue behind another connection's lock: the channel is
        # for enqueue, claim and finish, so it must be able to take their lock too.
        probe = getattr(getattr(store, "inner", store), "broker_write_probe", None)
        if probe is not None:
            # Within the channel's time, leaving it room to say why it is slow.
            await probe(timeout * 0.8)
        return await store.queues_stats(), await store.stale_commits(limit=5)

    async def writable(target: Store, channel: str) -> None:
        # Reads answer on a server that takes no writes (a standby, a read-only
        # role), and while another session holds a table against writes: the
        # channel must be able to write too.
        probe = getattr(getattr(target, "inner", target), "write_probe", None)
        if probe is not None:
            # Within the channel's time, leaving it room to say why it is slow.
            await probe(channel, timeout * 0.8)

    async def leases() -> tuple[float, Any, Any]:
        await writable(store, "leases")
        named = await store.resource_leases_list() if dependencies else []
        records = await store.workers_list()
        # The clock after the rows it ages (see cli/maintenance.py current_leader).
        return await store.store_time(), records, named

    async def ledger() -> None:
        if store.capabilities.ledger:
            # A split store's own ledger: its audit merges Redis's refusals, which
            # would make a Redis outage look like a ledger one.
            ledger_store = getattr(store, "ledger", None)
            target = ledger_store if isinstance(ledger_store, Store) else store
            await writable(target, "ledger")
            await target.duplicates_list(limit=1)

    try:
        # A role that did not open is not asked again: its failure is known.
        queues, membership, _ = await asyncio.gather(
            probes["broker"].run(broker, left, skip="broker" in down),
            probes["leases"].run(leases, left, skip="leases" in down),
            probes["ledger"].run(ledger, left, skip="ledger" in down),
        )
    finally:
        await _close(store, timeout)
    report: dict[str, Any] = {"store": "ok", "error": None}
    report["channels"] = {name: p.json() for name, p in probes.items()}
    for name, exc in down.items():
        report["channels"][name] = _failing(failure_kind(exc), str(exc) or type(exc).__name__)
    _name_servers(store, report["channels"])
    if not store.capabilities.ledger:
        report["channels"]["ledger"] = dict(_NOT_PROVIDED)
    report |= _unknown_data(dependencies)
    # A channel said to fail (a split store's role that did not open, say) has no data
    # even when its probe answered: an empty list would read as a healthy, empty store.
    if queues is not None and report["channels"]["broker"]["ok"] is not False:
        report["queues"], report["stale_commits"] = queues
    if membership is not None and report["channels"]["leases"]["ok"] is not False:
        now, records, named = membership
        report["now"] = now
        report["workers"] = live(records, now)
        if dependencies:
            shared = read_shared(named, now)
            report["dependencies"] = {
                name: {"state": "closed", "open_until": None, "prober": None}
                | ({} if (b := shared.get(name)) is None else _breaker_json(b))
                for name in dependencies
            }
    return report


def _unknown_data(dependencies: Sequence[str]) -> dict[str, Any]:
    """The report's data as it is when no channel answered: each item unknown."""
    data: dict[str, Any] = dict.fromkeys(("queues", "stale_commits", "now", "workers"))
    if dependencies:
        data["dependencies"] = None
    return data


def _breaker_json(b: SharedBreaker) -> dict[str, Any]:
    return {"state": b.state.value, "open_until": b.open_until, "prober": b.prober}


def alive(w: WorkerRecord, now: float) -> bool:
    """Whether the worker's membership lease is live by ``now`` (the store's clock)."""
    return w.expires_at > now and w.state != "stopped"


def live(records: list[WorkerRecord], now: float) -> list[WorkerRecord]:
    """The workers that are alive by ``now``."""
    return [w for w in records if alive(w, now)]


def worker_state(w: WorkerRecord, now: float) -> str:
    """The worker's state as a listing shows it: "(lost)" once its membership expired
    unstopped, "(drain requested)" while an operator's drain request waits for it."""
    if not alive(w, now):
        return w.state if w.state == "stopped" else f"{w.state} (lost)"
    if w.drain_requested and w.state not in ("draining", "stopped"):
        return f"{w.state} (drain requested)"
    return w.state


def lease_mismatch(current: ResourceLease, owner: str, token: int) -> str | None:
    """What of ``owner`` and ``token`` does not match the lease's holder, if anything."""
    wrong = []
    if owner != current.owner:
        wrong.append(f"owner {owner!r} is not its owner ({current.owner!r})")
    if token != current.token:
        older = " (a stale one)" if token < current.token else ""
        wrong.append(f"token {token}{older} is not its token ({current.token})")
    return " and ".join(wrong) or None
