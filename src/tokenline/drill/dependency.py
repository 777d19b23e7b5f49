"""The drill's dependency: a stub that the ``slow_dependency`` scenario makes time out,
the log of every call it gets, and the figures read back from that log and the store.

The stub answers in :data:`LATENCY` (5 ms). While the drill controller holds its flag
(:meth:`Stub.hang`), every call hangs far past :data:`TIMEOUT` — calls already under
way when it heals hang on, as requests sent to a sick server do. The flag and the log
are files in one directory, named to the worker processes by :data:`DIR_ENV`, so that
every process sees the same dependency::

    <dir>/hanging     present: calls hang
    <dir>/calls.log   one line per call that reached the dependency: its time (epoch s)

Lines are appended with one ``write`` on a file opened with ``O_APPEND``: the lines of
concurrent processes do not mix.

**Settings scaled to the drill.** The drill runs with a lease TTL of 2 s, a fifteenth of
the default; the settings that time the reaction to a failing dependency are cut to
match, or a fault would have to last minutes before anything happened: the breaker
(:data:`BREAKER`: a 0.2 s timeout, a 2 s window, 5 calls, open for 1 s) and, given to
the scenario's workers with breakers on and off alike (:data:`WORKER_ENV`), the retry
backoff, the retry budget's window and the window of the worker's own pause, each a
fifteenth of its default.

**Figures** (:func:`measure`): calls to the dependency, and per minute while the fault
lasted; attempts spent by calls that failed (their error names the dependency); jobs
dead-lettered; and the time from the heal to full throughput — to the first job
finished in the first 1 s span after the heal that holds at least
:data:`FULL_THROUGHPUT` of the jobs finished in the second before the fault or, when
too few were left for such a span, to the last job finished.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError

if TYPE_CHECKING:
    from ._scratch import ScratchStore
    from .checker import FaultWindow

__all__ = [
    "BREAKER",
    "DIR_ENV",
    "FULL_THROUGHPUT",
    "LATENCY",
    "NAME",
    "TIMEOUT",
    "WORKER_ENV",
    "DependencyFigures",
    "Stub",
    "back_to_full",
    "measure",
]

#: Names the stub's directory (the flag and the call log) to the worker processes.
DIR_ENV = "TOKENLINE_DRILL_DEPENDENCY_DIR"
#: The dependency's name (``app.dependency``, ``depends_on``, errors, lease names).
NAME = "drill-dep"
#: Seconds a healthy call takes.
LATENCY = 0.005
#: Seconds a call may take before it counts as timed out.
TIMEOUT = 0.2
#: Seconds a call takes while the dependency hangs: far past the timeout.
HANG = 10.0
#: The breaker's settings (``app.dependency(NAME, **BREAKER)``).
#: A window of a fifteenth of the default 30 s, as for the TTL: one that kept the
#: outcomes of the last 5 s would hold the breaker closed for seconds under a high rate
#: of successes before the fault (it opens once the bad calls are half of the window's).
BREAKER: dict[str, Any] = {"timeout": TIMEOUT, "window": 2.0, "min_calls": 5, "open_for": 1.0}
#: The scenario's worker settings, in the environment, each a fifteenth of its default:
#: retries back off from 0.067 s up to 20 s (1 s, 300 s), the retry budget is counted
#: over 4 s (60 s) and the worker's error window is 2 s (30 s).
WORKER_ENV = {
    "TOKENLINE_RETRY_BASE": "0.067",
    "TOKENLINE_RETRY_CAP": "20",
    "TOKENLINE_RETRY_BUDGET_WINDOW": "4",
    "TOKENLINE_PAUSE_WINDOW": "2",
}
#: Share of the rate before the fault that counts as full throughput again.
FULL_THROUGHPUT = 0.9

_FLAG = "hanging"
_LOG = "calls.log"


class Stub:
    """The dependency: a flag the controller sets, a log every call appends to."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.flag = self.directory / _FLAG
        self.log = self.directory / _LOG

    @classmethod
    def from_env(cls) -> Stub:
        """The stub whose directory :data:`DIR_ENV` names (worker processes)."""
        directory = os.environ.get(DIR_ENV)
        if not directory:
            raise ConfigError(DIR_ENV, "must name the drill dependency's directory")
        return cls(directory)

    def create(self) -> Stub:
        """Make the directory, healthy and with no call yet (the controller)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.flag.unlink(missing_ok=True)
        self.log.write_bytes(b"")
        return self

    def hang(self, on: bool) -> None:
        """Make every call from now on hang (``True``) or answer again (``False``)."""
        if on:
            self.flag.touch()
        else:
            self.flag.unlink(missing_ok=True)

    async def call(self) -> None:
        """One call: logged, then answered in :data:`LATENCY`, or hanging."""
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{time.time():.6f}\n".encode())
        finally:
            os.close(fd)
        await asyncio.sleep(HANG if self.flag.exists() else LATENCY)

    def calls(self) -> list[float]:
        """The times of every call so far, in order."""
        if not self.log.exists():
            return []
        return sorted(float(line) for line in self.log.read_text().split())


@dataclass(frozen=True, slots=True)
class DependencyFigures:
    """What the drill's dependency went through in one run (module docstring)."""

    #: Whether its calls went through a circuit breaker.
    breakers: bool
    #: Calls that reached it, over the whole run.
    calls: int
    #: Seconds the fault lasted.
    fault_seconds: float
    #: Calls per minute while the fault lasted.
    calls_per_minute: float
    #: Attempts spent by calls that failed (timed out).
    attempts_burned: int
    #: Jobs dead-lettered.
    dead_lettered: int
    #: Seconds from the heal to full throughput (``None``: no job finished after it).
    full_throughput_after: float | None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (a key of ``tokenline drill --json``)."""
        after = self.full_throughput_after
        return {
            "breakers": self.breakers,
            "calls": self.calls,
            "fault_seconds": round(self.fault_seconds, 2),
            "calls_per_minute_during_fault": round(self.calls_per_minute, 1),
            "attempts_burned": self.attempts_burned,
            "dead_lettered": self.dead_lettered,
            "full_throughput_seconds_after_heal": None if after is None else round(after, 2),
        }


def measure(
    stub: Stub, scratch: ScratchStore, fault: FaultWindow | None, *, breakers: bool
) -> DependencyFigures:
    """The figures of a run, from the stub's log and the store (module docstring)."""
    calls = stub.calls()
    t = scratch.tables
    (burned,) = scratch.rows(
        f"SELECT count(*) FROM {t['attempts']} WHERE outcome IN ('retry', 'dead') "
        f"AND error LIKE {scratch.placeholder}",
        (f"%{NAME!r}%",),
    )[0]
    dead = scratch.scalar(f"SELECT count(*) FROM {t['jobs']} WHERE state = 'dead'")
    finished = sorted(
        float(r[0])
        for r in scratch.rows(
            f"SELECT finished_at FROM {t['attempts']} "
            "WHERE outcome = 'succeeded' AND finished_at IS NOT NULL"
        )
    )
    if fault is None:
        return DependencyFigures(breakers, len(calls), 0.0, 0.0, int(burned), dead, None)
    seconds = fault.end - fault.start
    during = bisect.bisect_left(calls, fault.end) - bisect.bisect_left(calls, fault.start)
    return DependencyFigures(
        breakers=breakers,
        calls=len(calls),
        fault_seconds=seconds,
        calls_per_minute=during * 60 / seconds if seconds > 0 else 0.0,
        attempts_burned=int(burned),
        dead_lettered=dead,
        full_throughput_after=back_to_full(finished, fault.start, fault.end),
    )


def back_to_full(finished: Sequence[float], start: float, heal: float) -> float | None:
    """Seconds from ``heal`` to full throughput, from the sorted times jobs finished at
    (module docstring); ``None`` when no job finished after the heal."""
    after = bisect.bisect_left(finished, heal)
    if after == len(finished):
        return None
    drained = finished[-1] - heal
    first = finished[0] if finished else start
    since = max(start - 1.0, first)
    before = bisect.bisect_left(finished, start) - bisect.bisect_left(finished, since)
    if before < 2 or start - since <= 0:
        return drained  # no rate to compare with
    need = max(1, round(FULL_THROUGHPUT * before / (start - since)))
    for last in range(after + need - 1, len(finished)):
        lo = max(after, bisect.bisect_left(finished, finished[last] - 1.0))
        if last - lo + 1 >= need:
            return finished[lo] - heal
    return drained
