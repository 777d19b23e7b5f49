"""``tokenline status`` during a drill fault, seeing the store as the struck worker does.

An operator's first look in an incident is ``tokenline status``: which channel fails,
and on which server. On the split topology the drill proves it answers right while each
fault is on. The probe is the command itself, ``python -m tokenline status --json
--timeout …``, in a process of its own with the struck worker's environment: its store
URL (Redis through that worker's proxy, so a proxy fault cuts the probe too), its app
(whose stores the drill's FaultStore wraps) and its fault file (so a role fault fails
the probe's calls of that role as it fails the worker's). What it said becomes a
:class:`~.checker.StatusSeen`, which :func:`~.checker.check_status` holds to the
scenario's :class:`~.scenarios.StatusExpectation`.

Its output goes to ``status-<worker>.json`` (stderr to ``status-<worker>.log``) in the
run's directory, kept with the workers' logs when the run fails.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..stores import store_from_url
from ..stores.base import Role
from ._fleet import Fleet
from .checker import StatusSeen

__all__ = ["STATUS_TIMEOUT", "StatusProbe", "servers_of", "status_argv"]

#: ``--timeout`` of the probe: how long each server may take to open, and each channel
#: to answer. A cut channel costs about this much (twice, plus a grace, for a
#: blackhole), well inside a fault window of lease TTLs; a healthy one answers in
#: milliseconds, so a busy machine does not make it look slow.
STATUS_TIMEOUT = 1.5
#: How long the probe may run before it is killed, and its silence reported.
_DEADLINE = 30.0


def status_argv(app: str, url: str) -> list[str]:
    """The command line of the probe: ``tokenline status`` as an operator runs it."""
    return [
        sys.executable, "-m", "tokenline", "status", "--app", app, "--url", url,
        "--json", "--timeout", str(STATUS_TIMEOUT),
    ]  # fmt: skip


def servers_of(url: str) -> dict[str, str]:
    """The server that plays each channel of the store at ``url``, as the store spells
    it (``Redis at …``, ``PostgreSQL …``); empty for a store on one server. Nothing is
    opened."""
    server = getattr(store_from_url(url), "server", None)
    if server is None:
        return {}
    return {role.value: str(server(role.value)) for role in Role}


class StatusProbe:
    """One ``tokenline status`` process; :meth:`result` is what it said."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        servers: Mapping[str, str],
        out: Path,
        *,
        deadline: float = _DEADLINE,
    ) -> None:
        self.servers = dict(servers)
        self.out = out
        self.log = out.with_suffix(".log")
        self.deadline = deadline
        self._until = time.monotonic() + deadline
        self._silent = False
        with out.open("wb") as stdout, self.log.open("wb") as stderr:
            self._proc = subprocess.Popen(list(argv), env=dict(env), stdout=stdout, stderr=stderr)

    @classmethod
    def start(cls, fleet: Fleet, worker: int) -> StatusProbe:
        """Start the probe as ``worker`` of ``fleet`` (spawned) reaches the store."""
        env = fleet.envs[worker]
        url = env["TOKENLINE_URL"]
        out = fleet.work_dir / f"status-{worker}.json"
        return cls(status_argv(fleet.app, url), env, servers_of(url), out)

    def running(self) -> bool:
        """Whether the probe is still at work; one past its deadline is killed."""
        if self._proc.poll() is not None:
            return False
        if time.monotonic() < self._until:
            return True
        self._silent = True
        self.stop()
        return False

    def stop(self) -> None:
        """Kill the probe if it still runs (idempotent; the runner's ``finally``)."""
        if self._proc.poll() is None:
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)

    def result(self) -> StatusSeen:
        """What the probe said, once it ended (waited for, up to its deadline)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=max(0.0, self._until - time.monotonic()))
        if self._proc.poll() is None:
            self._silent = True
        self.stop()
        if self._silent:
            return self._failed(f"tokenline status gave no answer within {self.deadline:g}s")
        try:
            report = json.loads(self.out.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return self._failed(
                f"tokenline status exited {self._proc.returncode} without a JSON report"
            )
        return StatusSeen.from_report(report, self.servers)

    def _failed(self, why: str) -> StatusSeen:
        tail = self.log.read_text(errors="replace")[-500:].strip() if self.log.exists() else ""
        return StatusSeen({}, self.servers, f"{why}: {tail}" if tail else why)
