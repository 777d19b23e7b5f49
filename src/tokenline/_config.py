"""Frozen, validated settings with named defaults.

Every setting is validated when the object is built, and an invalid one raises
:class:`~tokenline.ConfigError` naming the setting and the reason. Values come from
arguments, then ``TOKENLINE_<NAME>`` environment variables, then a TOML file, in that
order of precedence (see :func:`load_settings`); an unknown key is an error, never
silently dropped.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import stat
import tomllib
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from ._errors import ConfigError, QueueNameError

__all__ = [
    "DEFAULT_URL",
    "QUEUE_NAME_RE",
    "Settings",
    "WorkerSettings",
    "load_settings",
    "validate_queue_name",
]


class _Unnamed(str):
    """The default store URL, as :class:`Settings` holds it when nobody named one: a
    ``str`` like any other, of a type of its own, so that ``App(settings=...)`` can tell
    it from the same URL written out (``Settings(url="sqlite:///tokenline.db")``)."""

    __slots__ = ()


DEFAULT_URL: str = _Unnamed("sqlite:///tokenline.db")


def names_no_store(url: str) -> bool:
    """Whether ``url`` is the default nobody named (see :class:`_Unnamed`)."""
    return isinstance(url, _Unnamed)


#: 1-64 characters from A-Z a-z 0-9 _ . : -, and not "." or "..": each is a path step
#: of its own in a URL (the dashboard's /queues/<name>), which browsers resolve away.
QUEUE_NAME_RE = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.:-]{1,64}$")

#: Default lease TTL in seconds: how long a silent worker keeps a job.
DEFAULT_LEASE_TTL = 30.0
#: Default renewal period: a third of the TTL, so two renewals can fail before expiry.
DEFAULT_RENEW_INTERVAL = 10.0

# -- the ranges of the settings ------------------------------------------------------------
# Each number a setting takes is checked against one of these, so that a typo (a TTL of
# 0.001 s, a concurrency of 10**9) is refused at start-up, naming the setting and the
# range, instead of overloading the store or overflowing a time computation later.

#: Longest duration any setting takes (seconds): 100 years, as ``MAX_DELAY`` of a job.
MAX_SECONDS = 3_155_760_000
#: Shortest and longest lease TTL (seconds): under half a second a lease renewed every
#: third of it is lost to a store round trip or a GC pause; past a day, the jobs of a
#: crashed worker wait that long.
MIN_LEASE_TTL = 0.5
MAX_LEASE_TTL = 86_400.0
#: Longest period of a worker's loops and windows (polling, maintenance, budgets), and
#: longest per-call store timeout (seconds): a day.
MAX_INTERVAL = 86_400.0
#: Most jobs one worker process runs at once.
MAX_CONCURRENCY = 10_000
#: Most jobs claimed in one round trip.
MAX_CLAIM_BATCH = 1000
#: Most rows deleted per prune transaction.
MAX_PRUNE_BATCH = 100_000
#: Most jobs the overload pause waits for before judging the error rate.
MAX_PAUSE_MIN_JOBS = 1_000_000
#: Largest ``max_payload_bytes``: 64 MiB.
MAX_PAYLOAD_LIMIT = 64 * 1024 * 1024
#: Largest ``max_attempts`` and ``max_lease_expiries``: the stores' integer column.
MAX_ATTEMPTS_SETTING = 2**31 - 1


def validate_queue_name(name: object) -> str:
    """Return ``name`` if it is a valid queue name, else raise :class:`QueueNameError`."""
    # fullmatch: with match, `$` lets a trailing newline through.
    if not isinstance(name, str) or not QUEUE_NAME_RE.fullmatch(name):
        raise QueueNameError(
            f"invalid queue name {name!r}: use 1-64 characters from A-Z a-z 0-9 _ . : -, "
            "not '.' or '..' alone"
        )
    return name


def _shown(value: object) -> str:
    """``repr(value)`` for an error message, short even for a huge integer."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}…"


def _positive(name: str, value: float, high: float = MAX_SECONDS, low: float = 0.0) -> None:
    """Refuse ``value`` unless it is a number (not a bool) in ``(0, high]``, or in
    ``[low, high]`` when ``low`` is above 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"must be a number, got {_shown(value)}")
    # An int is compared as it is: math.isfinite would overflow on 10**400.
    finite = isinstance(value, int) or math.isfinite(value)
    if not finite or value <= 0 or value < low or value > high:
        above = f"from {low:g}" if low > 0 else "above 0"
        raise ConfigError(name, f"must be a finite number {above} to {high:g}, got {_shown(value)}")


def _positive_int(name: str, value: int, high: int = MAX_ATTEMPTS_SETTING) -> None:
    """Refuse ``value`` unless it is a whole number (not a bool) from 1 to ``high``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ConfigError(name, f"must be a whole number from 1 to {high}, got {_shown(value)}")


def _flag(name: str, value: bool) -> None:
    """Refuse ``value`` unless it is ``True`` or ``False`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be True or False, got {_shown(value)}")


@dataclass(frozen=True, slots=True)
class Settings:
    """Settings of an :class:`~tokenline.App`: where the store is and what it accepts."""

    #: Store URL: ``sqlite:///path.db``, ``postgresql://…`` or ``memory://``.
    url: str = DEFAULT_URL
    #: Largest accepted JSON payload of one job, in bytes.
    max_payload_bytes: int = 1_048_576
    #: Attempts before a job that keeps failing transiently goes dead.
    max_attempts: int = 5
    #: Times a job's worker may lose its lease (crash, kill, pause or partition past
    #: the TTL) before the job goes dead; these do not count as attempts.
    max_lease_expiries: int = 3
    #: First retry delay bound (seconds); doubles per attempt, with full jitter.
    retry_base: float = 1.0
    #: Largest retry delay bound (seconds).
    retry_cap: float = 300.0
    #: Per-operation timeout for the store (seconds): a slower answer is an outage.
    store_timeout: float = 10.0
    #: Upgrade an outdated store schema when first opened. Off: the store refuses it
    #: with a hint to run ``tokenline migrate`` (for deployments that migrate by hand).
    migrate: bool = True
    #: Priority aging (seconds): a runnable job gains one priority point for every
    #: this many seconds it has waited since its ``run_at``, by the store's clock, so
    #: low-priority work cannot starve behind a steady stream of higher. Jobs that
    #: waited less keep the order of their own priorities.
    priority_aging: float = 60.0
    #: Split topology: the broker's URL (``redis://…``). With ``ledger`` set, the three
    #: role URLs replace ``url``.
    broker: str | None = None
    #: Split topology: the lease store's URL; the broker's Redis (the default) is the
    #: only one accepted.
    leases: str | None = None
    #: Split topology: the ledger's URL (``postgresql://…``).
    ledger: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError("url", f"must be a non-empty store URL, got {self.url!r}")
        roles = {"broker": self.broker, "leases": self.leases, "ledger": self.ledger}
        for role, value in roles.items():
            if value is not None and not isinstance(value, str):
                raise ConfigError(role, f"must be a store URL, got {_shown(value)}")
        if any(v is not None for v in roles.values()):
            for role in ("broker", "ledger"):
                if not roles[role]:
                    raise ConfigError(
                        role, "the split topology needs both a broker and a ledger URL"
                    )
        _positive_int("max_payload_bytes", self.max_payload_bytes, MAX_PAYLOAD_LIMIT)
        _positive_int("max_attempts", self.max_attempts)
        _positive_int("max_lease_expiries", self.max_lease_expiries)
        _positive("retry_base", self.retry_base)
        _positive("retry_cap", self.retry_cap)
        if self.retry_cap < self.retry_base:
            raise ConfigError("retry_cap", "must be >= retry_base")
        _positive("store_timeout", self.store_timeout, MAX_INTERVAL)
        _positive("priority_aging", self.priority_aging)
        _flag("migrate", self.migrate)

    @property
    def store_url(self) -> str:
        """The URL the app's store is built from: ``url``, or the split topology's
        when ``broker`` and ``ledger`` are set."""
        if self.broker is None or self.ledger is None:
            return self.url
        from .stores import split_url

        return split_url(self.broker, self.ledger, self.leases)


#: Default retention of succeeded and cancelled jobs (seconds): 7 days.
DEFAULT_RETENTION_FINISHED = 7 * 86_400.0
#: Default retention of dead jobs (seconds): 30 days, for operators to inspect.
DEFAULT_RETENTION_DEAD = 30 * 86_400.0
#: Default retention of the audit rows: refused stale commits and duplicates (30 days).
DEFAULT_RETENTION_AUDIT = 30 * 86_400.0

#: The most jobs a worker may hold prefetched (``WorkerSettings.prefetch``).
MAX_PREFETCH = 1000
#: ``WorkerSettings.prefetch`` that follows the worker's handler run times.
AUTO: Literal["auto"] = "auto"

#: The values of ``WorkerSettings.concurrency_control``.
CONCURRENCY_CONTROLS = ("aimd", "gradient", "fixed")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """Settings of one worker process: what it consumes and its tiered timeouts."""

    #: Queues to consume, in no particular order (priority decides within the set).
    queues: tuple[str, ...] = ("default",)
    #: Jobs run at the same time.
    concurrency: int = 10
    #: Lease time-to-live (seconds): a worker silent for this long loses its jobs.
    lease_ttl: float = DEFAULT_LEASE_TTL
    #: Period of the batched lease renewal and membership heartbeat (seconds; at most
    #: lease_ttl / 3). ``None``: a third of the TTL, at most DEFAULT_RENEW_INTERVAL.
    renew_interval: float | None = None
    #: Safety margin (seconds) under the TTL after which the worker fences itself.
    #: ``None``: a tenth of the TTL.
    lease_margin: float | None = None
    #: Longest wait for new jobs before polling the store again (seconds).
    poll_interval: float = 1.0
    #: Hard time limit of one attempt when its task sets none (seconds).
    job_timeout: float = 300.0
    #: Time given to in-flight jobs after a shutdown request (seconds).
    drain_timeout: float = 30.0
    #: Period of the rescue of expired leases by the maintenance leader (seconds).
    rescue_interval: float = 5.0
    #: Period of the reconciler's pass by the maintenance leader (seconds).
    reconcile_interval: float = 30.0
    #: How long an effect key may stay ``pending`` after its attempt lost its lease
    #: before the reconciler marks it failed so the job may run it again (seconds; at
    #: least ``lease_ttl``).
    effect_pending_deadline: float = 300.0
    #: Seconds a starting worker keeps trying to open, and register with, its store
    #: while the store is unavailable (down, refusing connections, busy, not answering),
    #: each failed try logged with its reason, before it gives up with the last error.
    #: 0: give up at once. Other errors (a damaged store, a schema to migrate) end the
    #: start at once.
    startup_wait: float = 0.0
    #: Per-call timeout for store operations of this worker (seconds); a slower answer
    #: counts as a coordination failure. ``None``: a third of the lease TTL.
    store_timeout: float | None = None
    #: Jobs claimed in one round trip; ``None``: up to the free concurrency.
    claim_batch: int | None = None
    #: Jobs claimed ahead of the running ones, each held under its lease (renewed) until
    #: a handler slot frees, so the next job starts while the last one's outcome is being
    #: written; one waiting longer than ``renew_interval`` is given back. 0: none.
    #: ``"auto"``: as many as keep a prefetched job's expected wait for a slot within
    #: 20 ms, from the worker's recent handler run times (none while handlers run longer
    #: than 20 ms; running and prefetched together at most 16), one waiting longer than
    #: 1 s given back.
    prefetch: int | Literal["auto"] = AUTO
    #: Log a warning when the worker's wall clock and the store's differ by more than
    #: this (seconds). Nothing the store decides depends on the worker's wall clock.
    clock_skew_warning: float = 1.0
    #: Check lease validity on the worker's own clock before every commit. Turning it
    #: off leaves only the store's token check; it exists for drills and tests.
    local_fencing: bool = True
    #: How the number of jobs run at once adapts to how jobs fare: ``aimd`` (halve on
    #: timeouts, transient and store errors, grow back by one), ``gradient`` (follow
    #: latency), or ``fixed`` (always ``concurrency``).
    concurrency_control: str = "aimd"
    #: The least the adaptive limit may fall to (at most ``concurrency``).
    concurrency_floor: int = 1
    #: Retries of a queue's jobs per first attempt, over ``retry_budget_window``; a
    #: retry beyond the budget waits a window instead of running at once.
    retry_budget: float = 0.2
    #: Seconds over which the retry budget is counted.
    retry_budget_window: float = 60.0
    #: Pause claiming (DRAINING) when at least this share of the recent jobs failed
    #: from overload (timeouts, transient or store errors); resume when it falls.
    pause_error_rate: float = 0.5
    #: Seconds of recent jobs the error rate is taken over.
    pause_window: float = 30.0
    #: Jobs needed in the window before the error rate may pause the worker.
    pause_min_jobs: int = 20
    #: Retention (seconds) of succeeded and cancelled jobs, with their attempts and
    #: released unique keys, counted from when they finished; at least ``lease_ttl``.
    retention_finished: float = DEFAULT_RETENTION_FINISHED
    #: Retention (seconds) of dead jobs, likewise; at least ``lease_ttl``.
    retention_dead: float = DEFAULT_RETENTION_DEAD
    #: Retention (seconds) of refused stale commits and recorded duplicates (the audit);
    #: at least ``lease_ttl``. Effect records and fences are never pruned.
    retention_audit: float = DEFAULT_RETENTION_AUDIT
    #: Seconds between two prunes by the maintenance leader.
    prune_interval: float = 60.0
    #: Rows deleted per prune transaction: small, so no lock is held for long.
    prune_batch: int = 1000
    #: Seconds between two passes of the periodic-job scheduler (maintenance leader).
    periodic_interval: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.queues, str):
            object.__setattr__(self, "queues", tuple(q for q in self.queues.split(",") if q))
        if not isinstance(self.queues, tuple | list):
            raise ConfigError("queues", f"must be a list of queue names, got {_shown(self.queues)}")
        object.__setattr__(self, "queues", tuple(self.queues))
        if not self.queues:
            raise ConfigError("queues", "at least one queue is needed")
        for q in self.queues:
            try:
                validate_queue_name(q)
            except QueueNameError as exc:
                raise ConfigError("queues", str(exc)) from None
        if len(set(self.queues)) != len(self.queues):
            twice = sorted({q for q in self.queues if self.queues.count(q) > 1})
            raise ConfigError("queues", f"lists {', '.join(map(repr, twice))} more than once")
        _positive_int("concurrency", self.concurrency, MAX_CONCURRENCY)
        _positive("lease_ttl", self.lease_ttl, MAX_LEASE_TTL, MIN_LEASE_TTL)
        for name in ("job_timeout", "drain_timeout", "effect_pending_deadline"):
            _positive(name, getattr(self, name))
        for name in ("poll_interval", "rescue_interval", "reconcile_interval"):
            _positive(name, getattr(self, name), MAX_INTERVAL)
        _positive("clock_skew_warning", self.clock_skew_warning, MAX_INTERVAL)
        if self.renew_interval is not None:
            _positive("renew_interval", self.renew_interval, MAX_INTERVAL)
        third = self.lease_ttl / 3
        if self.renew_period > third and not math.isclose(self.renew_period, third):
            raise ConfigError(
                "renew_interval",
                f"must be at most lease_ttl / 3 ({self.lease_ttl / 3:g}s) so that two "
                f"renewals can fail before the lease expires; got {self.renew_period:g}s",
            )
        if self.effect_pending_deadline < self.lease_ttl:
            raise ConfigError(
                "effect_pending_deadline",
                f"must be at least lease_ttl ({self.lease_ttl:g}s): an effect is only judged "
                "abandoned once its attempt's lease is gone; "
                f"got {self.effect_pending_deadline:g}s",
            )
        if self.lease_margin is not None:
            _positive("lease_margin", self.lease_margin)
            if self.lease_margin >= self.lease_ttl - self.renew_period:
                raise ConfigError("lease_margin", "must be smaller than lease_ttl - renew_interval")
        if isinstance(self.startup_wait, bool) or self.startup_wait != 0:
            try:
                _positive("startup_wait", self.startup_wait, MAX_INTERVAL)
            except ConfigError:
                raise ConfigError(
                    "startup_wait",
                    f"must be a finite number of seconds from 0 (do not wait) to "
                    f"{MAX_INTERVAL:g}, got {_shown(self.startup_wait)}",
                ) from None
        if self.store_timeout is not None:
            _positive("store_timeout", self.store_timeout)
        if self.store_timeout is not None and self.store_timeout >= self.lease_ttl:
            raise ConfigError(
                "store_timeout",
                "must be shorter than lease_ttl, or a slow store call outlives the lease",
            )
        if self.claim_batch is not None:
            _positive_int("claim_batch", self.claim_batch, MAX_CLAIM_BATCH)
        _flag("local_fencing", self.local_fencing)
        if self.prefetch == AUTO:
            pass
        elif isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int):
            raise ConfigError(
                "prefetch", f"must be {AUTO!r} or a whole number >= 0, got {self.prefetch!r}"
            )
        elif not 0 <= self.prefetch <= MAX_PREFETCH:
            raise ConfigError(
                "prefetch",
                f"must be from 0 to {MAX_PREFETCH} (jobs held under lease before they run); "
                f"got {self.prefetch}",
            )
        if self.concurrency_control not in CONCURRENCY_CONTROLS:
            raise ConfigError(
                "concurrency_control",
                f"must be one of {', '.join(CONCURRENCY_CONTROLS)}, "
                f"got {self.concurrency_control!r}",
            )
        _positive_int("concurrency_floor", self.concurrency_floor)
        if self.concurrency_floor > self.concurrency:
            raise ConfigError(
                "concurrency_floor",
                f"must be at most concurrency ({self.concurrency}), got {self.concurrency_floor}",
            )
        for name in ("retry_budget_window", "pause_window"):
            _positive(name, getattr(self, name), MAX_INTERVAL)
        for name in ("retry_budget", "pause_error_rate"):
            _positive(name, getattr(self, name), 1.0)
        _positive_int("pause_min_jobs", self.pause_min_jobs, MAX_PAUSE_MIN_JOBS)
        for name in ("retention_finished", "retention_dead", "retention_audit"):
            _positive(name, getattr(self, name))
            if getattr(self, name) < self.lease_ttl:
                raise ConfigError(
                    name,
                    f"must be at least lease_ttl ({self.lease_ttl:g}s): a row must outlive "
                    f"every lease that may still write about it; got {getattr(self, name):g}s",
                )
        _positive("prune_interval", self.prune_interval, MAX_INTERVAL)
        _positive_int("prune_batch", self.prune_batch, MAX_PRUNE_BATCH)
        _positive("periodic_interval", self.periodic_interval, MAX_INTERVAL)

    @property
    def call_timeout(self) -> float:
        """The effective per-call store timeout in seconds."""
        return self.store_timeout if self.store_timeout is not None else self.lease_ttl / 3

    @property
    def renew_period(self) -> float:
        """The effective renewal and heartbeat period in seconds."""
        if self.renew_interval is not None:
            return self.renew_interval
        return min(DEFAULT_RENEW_INTERVAL, self.lease_ttl / 3)

    @property
    def margin(self) -> float:
        """The effective self-fencing margin in seconds."""
        return self.lease_margin if self.lease_margin is not None else self.lease_ttl / 10


S = TypeVar("S", Settings, WorkerSettings)


def _field_type(cls: type[Any], name: str) -> type[Any]:
    """The declared type of field ``name``, with ``| None`` dropped."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and len(args) == 1:
        hint = args[0]
    return hint if isinstance(hint, type) else str


def parse_prefetch(text: str) -> int | Literal["auto"]:
    """``prefetch`` from text (an environment variable, an option): ``auto`` in any case,
    or a whole number (its range is checked by the settings); ValueError otherwise."""
    text = text.strip()
    return AUTO if text.lower() == AUTO else int(text)


def _coerce(cls: type[Any], name: str, raw: str) -> Any:
    """Turn an environment variable's text into the declared type of field ``name``."""
    kind = _field_type(cls, name)
    if name == "prefetch":
        try:
            return parse_prefetch(raw)
        except ValueError:
            raise ConfigError(name, f"cannot read {raw!r} as {AUTO!r} or a whole number") from None
    try:
        if name == "queues":
            return tuple(q.strip() for q in raw.split(",") if q.strip())
        if kind is bool:
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return low in ("1", "true", "yes", "on")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        raise ConfigError(name, f"cannot read {raw!r} as {kind.__name__}") from None
    return raw


#: The tables of a config file that tokenline reads: each one's settings class and the
#: tables it may hold. Every one present in a file is checked, whichever is being read,
#: so that a key in the wrong one is an error rather than silently unused.
_TABLES: dict[str, tuple[type[Any], frozenset[str]]] = {
    "tokenline": (Settings, frozenset({"worker"})),
    "tokenline.worker": (WorkerSettings, frozenset()),
}


#: The largest config file read (bytes): a settings file is a few hundred.
MAX_CONFIG_BYTES = 1 << 20


def _read_text(path: Path, shown: str) -> str:
    """The text of the regular file ``path``, at most :data:`MAX_CONFIG_BYTES`.

    Opened without blocking and checked before it is read: ``/dev/zero`` was read until
    memory ran out, and a FIFO held the command until something wrote to it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(shown)
        if not stat.S_ISREG(mode):
            raise ConfigError("config", f"{shown} is not a regular file, not a TOML file")
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            "config", f"{shown} is larger than {MAX_CONFIG_BYTES:,} bytes: not a settings file"
        )
    return data.decode("utf-8")


def _read_toml(path: Path) -> dict[str, Any]:
    """The parsed file, or :class:`ConfigError` naming it and why it cannot be read."""
    shown = repr(str(path))
    try:
        text = _read_text(path, shown)
    except FileNotFoundError:
        raise ConfigError("config", f"file {shown} does not exist") from None
    except IsADirectoryError:
        raise ConfigError("config", f"{shown} is a directory, not a TOML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "config",
            f"{shown} is not valid TOML: not UTF-8 text (byte {exc.object[exc.start]:#04x} "
            f"at offset {exc.start})",
        ) from None
    except OSError as exc:
        raise ConfigError("config", f"{shown} cannot be read: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{shown} is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib reads nested arrays and tables recursively
        raise ConfigError("config", f"{shown} is not valid TOML: nested too deeply") from None


def _table(data: dict[str, Any], section: str, shown: str) -> dict[str, Any] | None:
    """The table ``section`` (dotted) of ``data``, ``None`` if the file has none; a value
    (a number, an array, an array of tables) where a table is needed is an error."""
    table = data
    walked: list[str] = []
    for part in section.split("."):
        walked.append(part)
        value = table.get(part)
        if value is None:
            return None
        if not isinstance(value, dict):
            _not_a_table(".".join(walked), value, shown)
        table = value
    return table


def _not_a_table(name: str, value: object, shown: str) -> typing.NoReturn:
    """Refuse ``value``, found where the table ``[name]`` is due."""
    got = (
        f"an array of tables [[{name}]]"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value)
        else _shown(value)
    )
    raise ConfigError(name, f"must be a table [{name}] in {shown}, got {got}")


def _check_table(
    table: Mapping[str, Any], section: str, names: set[str], tables: frozenset[str], shown: str
) -> None:
    """Refuse a key of ``[section]`` that is neither a setting in ``names`` nor a table in
    ``tables``, a table given as a setting's value, and a value where a table is due."""
    for key, value in table.items():
        if key in tables:
            if not isinstance(value, dict):
                _not_a_table(f"{section}.{key}", value, shown)
            continue
        if key not in names and isinstance(value, dict):
            holds = (
                "holds settings and " + ", ".join(f"[{section}.{t}]" for t in sorted(tables))
                if tables
                else "holds settings, not tables"
            )
            raise ConfigError(f"{section}.{key}", f"unknown table in {shown}: [{section}] {holds}")
        if key not in names:
            where = [t for t, (c, _) in _TABLES.items() if t != section and key in _fields(c)]
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = ""
            if where:
                hint = f" (it belongs in [{where[0]}])"
            elif close:
                hint = f" (did you mean {close[0]!r}?)"
            raise ConfigError(key, f"unknown setting in [{section}] of {shown}{hint}")
        if isinstance(value, dict):
            raise ConfigError(key, f"must be a value, not a table, in [{section}] of {shown}")


def _fields(cls: type[Any]) -> set[str]:
    """The names of the settings of ``cls``."""
    return {f.name for f in dataclasses.fields(cls)}


def _squashed(name: str) -> str:
    """``name`` in lower case without separators, to compare table names loosely."""
    return re.sub(r"[\W_]+", "", name.lower())


def _not_read(data: Mapping[str, Any], wanted: list[str], names: set[str]) -> list[str]:
    """What in a file without tokenline's table looks meant for it: tables whose name is
    or resembles one of ``wanted`` (``[worker]``, ``[tokenline_worker]``,
    ``[tool.tokenline]``), and settings written outside any table."""
    squashed_wanted = [_squashed(w) for w in wanted]
    found: list[str] = []

    def walk(table: Mapping[str, Any], prefix: str, depth: int) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                squashed = _squashed(key)
                if any(
                    w in squashed or difflib.SequenceMatcher(None, squashed, w).ratio() >= 0.8
                    for w in squashed_wanted
                ):
                    found.append(f"[{prefix}{key}]")
                elif depth < 3:
                    walk(value, f"{prefix}{key}.", depth + 1)
            elif not prefix and key in names:
                found.append(f"{key} (outside any table)")

    walk(data, "", 0)
    return found


log = logging.getLogger("tokenline.config")

#: The ``TOKENLINE_*`` variables read elsewhere than as settings: by the app, the CLI,
#: the dashboard, the exporter, the demo and the drill.
_OTHER_VARIABLES = frozenset(
    f"TOKENLINE_{name}"
    for name in [
        "APP",
        "BROKER",
        "CONFIG",
        "DASHBOARD_ALLOWED_HOSTS",
        "DASHBOARD_BIND",
        "DASHBOARD_DRILL_RESULTS",
        "DASHBOARD_TOKEN",
        "DEMO_TABLE",
        "EXPORTER_HOST",
        "EXPORTER_MAX_AGE",
        "EXPORTER_PORT",
        "LEASES",
        "LEDGER",
        "LOG_LEVEL",
        "METRICS_HOST",
        "METRICS_PORT",
        "MIGRATE",
        "URL",
    ]
)
#: Variables already warned about, once per process.
_warned: set[str] = set()


def _warn_misspelt(env: Mapping[str, str]) -> None:
    """Warn, once per variable, of a ``TOKENLINE_*`` variable that tokenline does not
    read and that is close to one it does: a typo (``TOKENLINE_MAX_ATTEMTPS``) would
    otherwise leave the setting at its default without a word. Only close ones: an
    environment may hold variables of its own under the prefix."""
    known = {
        f"TOKENLINE_{name.upper()}" for cls, _ in _TABLES.values() for name in _fields(cls)
    } | _OTHER_VARIABLES
    for variable in env:
        if not variable.startswith("TOKENLINE_") or variable in known or variable in _warned:
            continue
        close = difflib.get_close_matches(variable, sorted(known), n=1, cutoff=0.85)
        if close:
            _warned.add(variable)
            log.warning(
                "environment variable %s is not one tokenline reads, and is ignored: "
                "did you mean %s?",
                *(variable, close[0]),
            )


def load_settings(
    cls: type[S],
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    file: str | os.PathLike[str] | None = None,
    section: str = "tokenline",
) -> S:
    """Build settings from arguments, then ``TOKENLINE_*`` variables, then a TOML file.

    ``overrides`` win over the environment, which wins over the file's ``[section]``
    table. Unknown keys in ``overrides`` or the file raise :class:`ConfigError`, and so
    does a file that cannot take effect: one that cannot be read or is not TOML, one
    with a value where a table is due or a table where a value is, one with a table
    tokenline does not know under its own (``[tokenline.worker.extra]``), and one with
    no tokenline table at all (no ``[tokenline]`` when ``section`` is
    ``tokenline.worker``; no ``[tool.tokenline]`` when it is ``tool.tokenline``). A file
    holding tokenline's table but not ``[section]`` gives no setting. Other tables (other
    tools', in a shared file) are left alone.
    """
    names = _fields(cls)
    values: dict[str, Any] = {}
    if file is not None:
        path = Path(file)
        shown = repr(str(path))
        data = _read_toml(path)
        table = _table(data, section, shown)
        parts: list[str] = section.split(".")
        # The table whose presence makes this tokenline's file: [tokenline] for
        # tokenline.worker, [tool.tokenline] for tool.tokenline, the section otherwise.
        home: int = parts.index("tokenline") if "tokenline" in parts else len(parts) - 1
        anchor = ".".join(parts[: home + 1])
        if _table(data, anchor, shown) is None:
            missed = _not_read(data, ["tokenline", *parts[home:]], names)
            unread = f" (not read: {', '.join(missed)})" if missed else ""
            raise ConfigError(
                "config",
                f"{shown} has no [{anchor}] table, so nothing in it would take "
                f"effect{unread}; put the settings in [{section}]",
            )
        for known, (known_cls, known_tables) in _TABLES.items():
            if known != section and (other := _table(data, known, shown)) is not None:
                _check_table(other, known, _fields(known_cls), known_tables, shown)
        if table is not None:
            tables = _TABLES[section][1] if section in _TABLES else frozenset()
            _check_table(table, section, names, tables, shown)
            values.update({k: v for k, v in table.items() if k in names})
        if "queues" in values and isinstance(values["queues"], list):
            values["queues"] = tuple(values["queues"])
    env = os.environ if environ is None else environ
    _warn_misspelt(env)
    # The settings taken from a variable, with its text: an error about one of them
    # names the variable, which is what the reader has to fix.
    from_env: dict[str, str] = {}
    for name in names:
        raw = env.get(f"TOKENLINE_{name.upper()}")
        if raw is not None and raw != "":
            from_env[name] = raw
            try:
                values[name] = _coerce(cls, name, raw)
            except ConfigError as exc:
                _name_variable(exc, raw)
                raise
    for key, value in (overrides or {}).items():
        if key not in names:
            raise ConfigError(key, f"unknown setting for {cls.__name__}")
        if value is not None:
            values[key] = value
            from_env.pop(key, None)
    try:
        return cls(**values)
    except ConfigError as exc:
        if exc.setting in from_env:
            _name_variable(exc, from_env[exc.setting])
        raise


def not_in_effect(
    file: str | os.PathLike[str], applied: Settings, *, overridden: Collection[str] = ()
) -> list[str]:
    """The ``[tokenline]`` keys of ``file`` whose value differs from ``applied`` (the
    settings an app runs with), each as ``key = value (the app runs with value)``;
    ``overridden``: keys an option or a variable set, which win over the file.

    A worker's ``--config`` applies ``[tokenline.worker]``; the app's settings come from
    the code that built it (``App(...)``, which may load this same file) and the
    ``TOKENLINE_*`` variables. A key that agrees is in effect through the app; one that
    differs would be silently ignored."""
    path = Path(file)
    table = _table(_read_toml(path), "tokenline", repr(str(path))) or {}
    names = _fields(Settings)
    given = {k: v for k, v in table.items() if k in names and k not in overridden}
    if not given:
        return []
    # Validated and normalized as the app's own settings are (no environment: the
    # file's values alone).
    wanted = load_settings(Settings, given, environ={})
    out = []
    for key in sorted(given):
        want, have = getattr(wanted, key), getattr(applied, key)
        if want != have:
            out.append(f"{key} = {want!r} (the app runs with {have!r})")
    return out


def _name_variable(exc: ConfigError, raw: str) -> None:
    """Make the message of ``exc`` name the ``TOKENLINE_…`` variable its setting was
    read from, and that variable's text, as the command line does; ``setting`` and
    ``reason`` are left as they are."""
    variable = f"TOKENLINE_{exc.setting.upper()}"
    exc.args = (f"{variable}={_shown(raw)} is invalid (setting {exc.setting}): {exc.reason}",)
