"""Helpers to run real worker processes against a SQLite file and watch the store."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
#: Generous: these tests must pass on a slow, noisy machine.
DEADLINE = 60.0


class Cluster:
    """Worker processes on one SQLite store, started through the real CLI."""

    def __init__(self, tmp: Path) -> None:
        self.db = tmp / "acc.db"
        self.url = f"sqlite:///{self.db}"
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        # Creates the schema (the commands that only read refuse a store not there).
        created = self.cli("migrate")
        assert created.returncode == 0, created.stdout + created.stderr
        with self.sql() as conn:
            conn.execute(
                "CREATE TABLE effects (key TEXT, job_id INTEGER, token INTEGER, worker TEXT)"
            )

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "TOKENLINE_URL": self.url,
            # The test apps here, and tests/sabotage.py for the control experiments.
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
            ),
            **extra,
        }

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tokenline", *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )

    def worker(self, name: str, *opts: str, **env: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        cmd = [
            sys.executable, "-m", "tokenline", "worker", "--app", "faultapp:app",
            "--queues", "acc", "--concurrency", "2", "--lease-ttl", "2",
            "--renew-interval", "0.5", "--rescue-interval", "0.5", "--poll-interval", "0.05",
            *opts,
        ]  # fmt: skip
        with log.open("wb") as fh:
            proc = subprocess.Popen(cmd, env=self.env(**env), stdout=fh, stderr=fh)
        self.procs.append((proc, log))
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        for p, log in self.procs:
            if p is proc:
                return log.read_text(errors="replace")
        raise KeyError(proc)

    @contextlib.contextmanager
    def sql(self) -> Iterator[sqlite3.Connection]:
        """The store file, with its coordination file (leases, workers) as ``coord``."""
        conn = sqlite3.connect(self.db, timeout=30, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("ATTACH DATABASE ? AS coord", (f"{self.db}-coord",))
        try:
            yield conn
        finally:
            conn.close()

    def query(self, sql: str, *params: Any) -> list[sqlite3.Row]:
        with self.sql() as conn:
            return conn.execute(sql, params).fetchall()

    def wait_for(self, what: str, check: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.05)
        logs = "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log in self.procs
        )
        pytest.fail(f"timed out waiting for {what}\n{logs}")

    def job(self, job_id: int) -> sqlite3.Row:
        """The job's row, with its lease's current expiry as ``live_expires_at``."""
        (row,) = self.query(
            "SELECT j.*, l.expires_at AS live_expires_at FROM tokenline_jobs AS j "
            "LEFT JOIN coord.job_leases AS l ON l.job_id = j.id AND l.token = j.lease_token "
            "WHERE j.id = ?",
            job_id,
        )
        return row

    def stop_all(self) -> None:
        for proc, _ in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A fresh store with an effects table; every process is killed afterwards."""
    sys.path.insert(0, str(HERE))
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()
