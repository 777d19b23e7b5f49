"""Periodic jobs: a task, a cron expression, an explicit time zone, a catch-up mode.

``@app.periodic(cron="*/5 * * * *", timezone="Europe/Paris", catch_up="latest")``
registers the function as a task and as a schedule; the maintenance leader's scheduler
(``maintenance/scheduler.py``) enqueues one job per instant.

* **cron**: five fields (minute hour day month weekday), or six with seconds last
  (``"* * * * * */10"``: every 10 seconds), parsed by ``croniter``. It must match
  some instant: one that never does (``"0 0 30 2 *"``, February 30th) or only more
  than :data:`MAX_CRON_GAP_YEARS` years apart is refused at registration, since the
  scheduler could never compute its next instant.
* **timezone**: an IANA zone name (``"UTC"``, ``"Europe/Paris"``), never the machine's:
  the cron's times are wall-clock times in that zone. Across daylight saving time, the
  instants are croniter's: a time that a spring-forward skips runs at the first valid
  time after it (02:30 → 03:00), a time that a fall-back repeats runs at both of its
  instants (they are an hour apart).
* **catch_up**: what to do with instants missed while no leader ran the scheduler
  (:data:`CATCH_UP`): ``"all"`` enqueues every one, ``"latest"`` only the most recent,
  ``"skip"`` none — only an instant seen on time (within the scheduler's grace) runs.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from ._errors import ConfigError
from ._jobs import check_queue_name, describe
from ._records import MAX_KEY_LENGTH

__all__ = ["CATCH_UP", "MAX_CRON_GAP_YEARS", "Periodic", "cron_problem"]

#: The values of ``catch_up``.
CATCH_UP = ("all", "latest", "skip")

#: Names the zone database may hold that stand for the machine's zone, not a place's.
_MACHINE_ZONES = frozenset({"localtime", "posixrules"})

#: The longest gap between two instants of a schedule, in years: croniter's own search
#: limit, past which it gives up computing the next instant.
MAX_CRON_GAP_YEARS = 50


def cron_problem(cron: object) -> str | None:
    """Why ``cron`` is no schedule the scheduler can run, or ``None``.

    Checked: a string of five fields (minute hour day month weekday) or six (seconds
    last), or one of croniter's ``@`` names (``@hourly``, ``@daily`` …); valid field
    values; and an instant both after and before now within :data:`MAX_CRON_GAP_YEARS`
    years, which is what the scheduler computes at every pass. (Searched in UTC: a time
    zone moves instants by hours, never whether the fields can match at all.)
    """
    if not isinstance(cron, str):
        return f"must be a cron expression string, got {describe(cron)}"
    fields = cron.split()
    named = len(fields) == 1 and fields[0].startswith("@")
    if not named and len(fields) not in (5, 6):
        return (
            f"{describe(cron)} has {len(fields)} fields; a cron expression has five "
            "(minute hour day month weekday), or six with seconds last"
        )
    if not croniter.is_valid(cron):
        return (
            f"not a valid cron expression: {describe(cron)} (five fields: minute hour day "
            "month weekday; or six, with seconds last)"
        )
    if not named and (backwards := _backwards_range(fields)) is not None:
        return f"{describe(cron)}: {backwards}"
    now = dt.datetime.now(dt.UTC)
    try:
        croniter(cron, now).get_next(float)
        croniter(cron, now).get_prev(float)
    except (CroniterError, ValueError, OverflowError) as exc:
        return (
            f"{describe(cron)} never matches: no instant within {MAX_CRON_GAP_YEARS} years "
            f"of now ({exc}); a day its month never has, such as February 30th?"
        )
    return None


#: Each field's name and range, in order (seconds last).
_FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day", 1, 31),
    ("month", 1, 12),
    ("weekday", 0, 6),
    ("second", 0, 59),
)


def _backwards_range(fields: list[str]) -> str | None:
    """A numeric range written high to low (``1-0``), which croniter takes for a
    schedule matching every value of the field: never what was meant."""
    for (name, first, last), value in zip(_FIELDS, fields, strict=False):
        for part in value.split(","):
            low, dash, high = part.split("/", 1)[0].partition("-")
            if dash and low.isdigit() and high.isdigit() and int(low) > int(high):
                return (
                    f"the {name} field's range '{low}-{high}' runs backwards: write it "
                    f"low to high, or as two ranges ('{low}-{last},{first}-{high}')"
                )
    return None


@dataclass(frozen=True, slots=True)
class Periodic:
    """One schedule: which task runs, with which arguments, at which instants.

    ``name`` identifies the schedule in the store (its high-water mark) and in each
    job's idempotency key (``periodic:<name>:<instant in UTC>``); it defaults to the
    task's name. Every field is checked here: a bad one is a :class:`ConfigError`
    naming it, when the decorator runs (at import, before any worker starts).
    """

    name: str
    task: str
    cron: str
    timezone: str = "UTC"
    catch_up: str = "latest"
    queue: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    zone: ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (problem := cron_problem(self.cron)) is not None:
            raise ConfigError("cron", problem)
        if not isinstance(self.timezone, str) or not self.timezone:
            raise ConfigError(
                "timezone", f"must be an IANA zone name, got {describe(self.timezone)}"
            )
        if self.timezone.lower() in _MACHINE_ZONES:
            # Found in the zone database as a link to the machine's own zone: a schedule
            # would move with the host it runs on.
            raise ConfigError(
                "timezone",
                f"{self.timezone!r} is the machine's zone, which differs from host to host: "
                "name an IANA zone such as 'UTC' or 'Europe/Paris'",
            )
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ConfigError(
                "timezone",
                f"unknown time zone {describe(self.timezone)} (an IANA name such as "
                "'UTC' or 'Europe/Paris')",
            ) from None
        object.__setattr__(self, "zone", zone)
        if self.catch_up not in CATCH_UP:
            raise ConfigError(
                "catch_up", f"must be one of {', '.join(CATCH_UP)}, got {describe(self.catch_up)}"
            )
        if self.queue is not None:
            try:
                check_queue_name(self.queue)
            except ValueError as exc:
                raise ConfigError("queue", str(exc)) from None
        if not isinstance(self.name, str) or not self.name or len(self.key(0.0)) > MAX_KEY_LENGTH:
            raise ConfigError(
                "name", f"must be a short non-empty string, got {describe(self.name)}"
            )
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs))

    def key(self, instant: float) -> str:
        """The idempotency key of the job of ``instant`` (epoch seconds)."""
        when = dt.datetime.fromtimestamp(instant, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"periodic:{self.name}:{when}"

    def instants(self, after: float, until: float, limit: int) -> list[float]:
        """The schedule's instants in ``(after, until]``, oldest first, at most
        ``limit`` of them (the oldest)."""
        it = croniter(self.cron, dt.datetime.fromtimestamp(after, self.zone))
        found: list[float] = []
        while len(found) < limit:
            nxt = float(it.get_next(float))
            if nxt > until:
                break
            if nxt > after:  # croniter never goes back; this only guards the bound
                found.append(nxt)
        return found

    def latest(self, until: float) -> float:
        """The schedule's last instant at or before ``until``."""
        # Just after ``until``, so that an instant exactly at ``until`` counts.
        it = croniter(self.cron, dt.datetime.fromtimestamp(until + 0.001, self.zone))
        prev = float(it.get_prev(float))
        while prev > until:
            prev = float(it.get_prev(float))
        return prev
