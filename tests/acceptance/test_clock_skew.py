"""Workers whose wall clocks are an hour off, beside a normal one, on PostgreSQL.

The clocks are shifted by Debian's libfaketime, preloaded below Python: every ``time()``
of the process, its libraries' included, is an hour off. Nothing the store
decides may follow that clock: the worker an hour ahead must not rescue live leases,
the one an hour behind must claim jobs like the others, and the jobs of the one ahead,
killed mid-run, must come back within lease TTL + rescue interval by the database's
clock. Each worker reports its skew with its heartbeat.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres]

HERE = Path(__file__).parent
DEADLINE = 90.0
TTL = 2.0
RESCUE = 0.5
JOBS = 60
#: The wall-clock shift of the workers ahead and behind.
SKEW = 3600


class Fleet:
    """Worker processes on one PostgreSQL schema, some under faketime."""

    def __init__(self, server: str, tmp: Path, libfaketime: str) -> None:
        import psycopg

        self.libfaketime = libfaketime
        self.logs: list[Any] = []
        self.schema = f"tl_skew_{uuid.uuid4().hex[:8]}"
        self.url = f"{server}?schema={self.schema}&options=-c%20search_path%3D{self.schema}"
        self.server = server
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {self.schema}")
            conn.execute(
                f"CREATE TABLE {self.schema}.skew_effects (key text, token bigint, owner text)"
            )

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "TOKENLINE_URL": self.url,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        }

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "tokenline", *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    def worker(self, name: str, shift: str | None) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "tokenline", "worker", "--app", "skewapp:app",
            "--queues", "skew", "--concurrency", "3", "--lease-ttl", str(TTL),
            "--renew-interval", "0.5", "--rescue-interval", str(RESCUE),
            "--poll-interval", "0.05",
        ]  # fmt: skip
        env = self.env()
        if shift is not None:
            env.update(LD_PRELOAD=self.libfaketime, FAKETIME=shift)
        log = (self.tmp / f"{name}.log").open("wb")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
        return self.procs[name]

    def enqueue(self, items: list[tuple[str, float]]) -> None:
        """Enqueue one job of skewapp's task per item, from this (unshifted) process."""
        from tokenline import App

        app = App(self.url)
        app.task(name="skew.work", queue="skew")(lambda ctx, key, seconds: None)
        try:
            app.enqueue_many("skew.work", items)
        finally:
            app.close()

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.server, autocommit=True) as conn:
            conn.execute(f"SET search_path TO {self.schema}")
            return conn.execute(sql, params).fetchall()

    def wait_for(self, what: str, check: Any) -> Any:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.05)
        logs = "\n".join(
            f"--- {n}\n{(self.tmp / f'{n}.log').read_text(errors='replace')[-2000:]}"
            for n in self.procs
        )
        pytest.fail(f"timed out waiting for {what}\n{logs}")

    def close(self) -> None:
        import psycopg

        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for log in self.logs:
            log.close()
        with psycopg.connect(self.server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")


@pytest.fixture
def fleet(postgres_server: str, tmp_path: Path, libfaketime: str) -> Iterator[Fleet]:
    """A fresh schema with a business table; every process is killed afterwards."""
    f = Fleet(postgres_server, tmp_path, libfaketime)
    try:
        yield f
    finally:
        f.close()


def test_workers_an_hour_off_rescue_nothing_early_and_claim_normally(fleet: Fleet) -> None:
    """One worker an hour ahead (killed mid-run), one an hour behind, one on time: every
    job runs once, only the killed worker's leases are rescued, within TTL + rescue
    interval of its death by the database's clock, and the worker behind works too."""
    fleet.cli("migrate")
    ahead = fleet.worker("ahead", f"+{SKEW}s")
    behind = fleet.worker("behind", f"-{SKEW}s")
    fleet.worker("on-time", None)

    def skews() -> dict[int, float] | None:
        rows = fleet.rows("SELECT pid, clock_skew FROM workers WHERE clock_skew IS NOT NULL")
        found = {int(pid): float(skew) for pid, skew in rows}
        return found if ahead.pid in found and behind.pid in found else None

    measured = fleet.wait_for("both skewed workers to report their skew", skews)
    assert measured[ahead.pid] == pytest.approx(SKEW, abs=60)
    assert measured[behind.pid] == pytest.approx(-SKEW, abs=60)
    # Only now: a skewed worker slow to start must not find the jobs all run.
    fleet.enqueue([(f"k{i}", 0.4) for i in range(JOBS)])

    def ahead_is_running() -> bool:
        rows = fleet.rows(
            "SELECT count(*) FROM jobs WHERE state = 'running' AND lease_owner LIKE %s",
            f"%-{ahead.pid}-%",
        )
        return bool(rows[0][0])

    fleet.wait_for("the worker ahead to run jobs", ahead_is_running)
    ahead.send_signal(signal.SIGKILL)
    ahead.wait(timeout=DEADLINE)
    (killed_at,) = fleet.rows("SELECT extract(epoch FROM clock_timestamp())::float8")[0]

    def all_done() -> bool:
        return fleet.rows("SELECT count(*) FROM jobs WHERE state <> 'succeeded'")[0][0] == 0

    fleet.wait_for("every job to succeed", all_done)
    effects = fleet.rows("SELECT key, count(*) FROM skew_effects GROUP BY key")
    assert len(effects) == JOBS
    assert all(n == 1 for _, n in effects), effects
    attempts = fleet.rows("SELECT owner, outcome, finished_at FROM attempts")
    rescued = [(owner, at) for owner, outcome, at in attempts if outcome == "lease_expired"]
    assert rescued, "the killed worker held jobs: they must have been rescued"
    assert all(f"-{ahead.pid}-" in owner for owner, _ in rescued), rescued
    # The lease ran out at most TTL after the kill, the rescue came within one rescue
    # interval of that; slack for a slow machine.
    assert max(at for _, at in rescued) - killed_at < TTL + RESCUE + 5
    owners = {owner for owner, _, _ in attempts}
    assert any(f"-{behind.pid}-" in owner for owner in owners), "the worker behind never worked"
    assert fleet.rows("SELECT count(*) FROM stale_commits")[0][0] == 0
    out = fleet.cli("workers", "--all")
    assert "-3600." in out or "-3599." in out, out
