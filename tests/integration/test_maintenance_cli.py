"""``tokenline reconcile``, ``tokenline maintenance`` and the leader in ``tokenline
workers``, against a real SQLite store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline._jobs import NewJob, WorkerRecord
from tokenline.cli import main
from tokenline.maintenance import MAINTENANCE_LEASE
from tokenline.stores import store_from_url
from tokenline.stores.base import ResourceLease
from tokenline.stores.sqlite import SQLiteStore

DEADLINE = 60.0


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines are not cut to 80 columns, so assertions can read them whole."""
    from tokenline.cli import _common

    monkeypatch.setattr(_common.console, "width", 250)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


async def _open(url: str) -> SQLiteStore:
    store = store_from_url(url)
    assert isinstance(store, SQLiteStore)
    await store.open()
    return store


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A SQLite store with a running job and an attempt of it left open behind the
    store's back (as by a lost worker whose job moved on)."""
    u = f"sqlite:///{tmp_path / 'm.db'}"

    async def seed() -> None:
        store = await _open(u)
        await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
        (c,) = await store.jobs_claim(owner="w-1", queues=["default"], limit=1, ttl=300)
        with sqlite3.connect(store.path) as conn:
            conn.execute(
                "INSERT INTO tokenline_attempts (job_id, token, attempt, owner, started_at) "
                "VALUES (?, 0, 1, 'lost', 0)",
                (c.job.id,),
            )
        await store.close()

    asyncio.run(seed())
    return u


def test_reconcile_dry_run_then_repair_then_nothing(url: str) -> None:
    """--dry-run reports the open attempt and changes nothing (exit 1); the pass repairs
    it (exit 1, a line and the counts); the next pass finds nothing (exit 0)."""
    code, out = run("reconcile", "--url", url, "--dry-run", "--json")
    assert code == 1
    data = json.loads(out)
    assert (data["dry_run"], data["counts"]) == (True, {"attempt_open": 1})
    code, out = run("reconcile", "--url", url, "--dry-run")
    assert code == 1
    assert "would repair attempt_open" in out
    code, out = run("reconcile", "--url", url)
    assert code == 1
    assert "repaired attempt_open: attempt of job 1 token 0 by lost left open" in out
    assert "repaired 1: attempt_open 1" in out
    code, out = run("reconcile", "--url", url)
    assert (code, out.strip()) == (0, "nothing to repair")


@pytest.mark.parametrize("args", [[], ["--dry-run"], ["--json"], ["--dry-run", "--json"]])
def test_reconcile_that_cannot_reach_its_store_says_it_could_not_act(args: list[str]) -> None:
    """A store that did not answer made reconcile exit 1, its status for "something
    was repaired": a cron job read the outage as repairs made. It is 2, could not act,
    with the error on stderr and nothing on stdout, --json too."""
    pytest.importorskip("psycopg")
    import socket

    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    url = f"postgresql://postgres@127.0.0.1:{closed_port}/test?schema=x&connect_timeout=2"
    result = CliRunner().invoke(main, ["reconcile", "--url", url, *args])
    assert result.exit_code == 2, result.output
    assert f"127.0.0.1:{closed_port}" in result.stderr
    assert result.stdout == ""


def test_reconcile_cannot_act_while_another_process_leads(url: str) -> None:
    """With the maintenance lease held elsewhere, reconcile repairs nothing, names the
    leader and exits 2; the dry run still reports."""

    async def hold() -> None:
        store = await _open(url)
        await store.resource_lease_acquire(resource=MAINTENANCE_LEASE, owner="busy", ttl=300)
        await store.close()

    asyncio.run(hold())
    code, out = run("reconcile", "--url", url)
    assert code == 2
    assert "busy leads maintenance (term 1)" in out
    assert run("reconcile", "--url", url, "--dry-run")[0] == 1


def test_workers_shows_the_leader_and_its_term(url: str) -> None:
    """tokenline workers names the maintenance leader and its term; --json marks the
    leading worker's row with it."""
    assert "maintenance leader: none now" in run("workers", "--url", url)[1]

    async def lead() -> None:
        store = await _open(url)
        rec = WorkerRecord("w-1", "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)
        await store.worker_register(record=rec, ttl=300)
        await store.resource_lease_acquire(resource=MAINTENANCE_LEASE, owner="w-1", ttl=300)
        await store.close()

    asyncio.run(lead())
    code, out = run("workers", "--url", url)
    assert code == 0
    assert "maintenance leader: w-1, term 1" in out
    (row,) = json.loads(run("workers", "--url", url, "--json")[1])
    assert row["leader_term"] == 1


def _lease(url: str) -> ResourceLease | None:
    async def read() -> ResourceLease | None:
        store = await _open(url)
        try:
            for lease in await store.resource_leases_list():
                if lease.resource == MAINTENANCE_LEASE:
                    return lease
            return None
        finally:
            await store.close()

    return asyncio.run(read())


def test_maintenance_process_leads_repairs_and_stops_cleanly(url: str, tmp_path: Path) -> None:
    """tokenline maintenance takes the leadership, its reconciler repairs the open
    attempt, its metrics (on a port of its choosing, whose URL it prints: it used not
    to) count the repair and show the term, and on SIGTERM it exits 0 having given
    the lease back."""
    env = {**os.environ, "TOKENLINE_RECONCILE_INTERVAL": "0.2"}
    command = ["maintenance", "--url", url, "--metrics-port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenline", *command],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + DEADLINE
        assert proc.stdout is not None
        # A line never printed must fail the test, not hang it: the kill ends the read.
        watchdog = threading.Timer(DEADLINE, proc.kill)
        watchdog.start()
        try:
            printed = [proc.stdout.readline(), proc.stdout.readline()]
        finally:
            watchdog.cancel()
        (metrics_url,) = [line.split(" on ")[1].strip() for line in printed if "/metrics" in line]
        assert metrics_url.startswith("http://127.0.0.1:"), printed
        assert not metrics_url.startswith("http://127.0.0.1:0/"), printed
        while run("reconcile", "--url", url, "--dry-run")[0] != 0:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the maintenance process repaired nothing"
            time.sleep(0.2)
        held = _lease(url)
        assert held is not None
        assert held.owner.startswith("maintenance-")
        repaired = 'tokenline_maintenance_repairs_total{kind="attempt_open",service="reconciler"}'
        text = ""
        while f"{repaired} 1.0" not in text:
            assert time.monotonic() < deadline, f"no repair in the metrics: {text}"
            time.sleep(0.1)
            with contextlib.suppress(OSError):
                text = urllib.request.urlopen(metrics_url).read().decode()
        assert f"tokenline_maintenance_leader_term {float(held.token)}" in text
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "maintenance stopped" in out
    assert "attempt_open" in err  # the repair was logged
    # Without --app it runs no schedule, and says what that means while it leads.
    assert "note: this process runs no periodic schedule (no --app" in " ".join(err.split())
    after = _lease(url)
    assert after is not None
    assert after.expires_at <= time.time() + 1  # released, not left to expire


@pytest.mark.parametrize(
    ("name", "value"),
    [("RECONCILE_INTERVAL", "0"), ("RESCUE_INTERVAL", "nan"), ("EFFECT_PENDING_DEADLINE", "1")],
)
def test_maintenance_settings_that_cannot_work_are_refused_at_start(
    url: str, name: str, value: str
) -> None:
    """A zero or NaN interval, or a pending-effect deadline under the lease TTL, stops
    both commands before they touch the store, naming the setting and its variable,
    with the exit status of bad input."""
    for command in (["maintenance"], ["reconcile"]):
        result = CliRunner().invoke(
            main, [*command, "--url", url], env={f"TOKENLINE_{name}": value}
        )
        assert result.exit_code == 2, result.output
        assert name.lower() in result.output
        assert f"TOKENLINE_{name}={value!r}" in result.output


def _spawn_maintenance(url: str, tmp_path: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "TOKENLINE_LEASE_TTL": "4",
        "TOKENLINE_RENEW_INTERVAL": "1",
        "TOKENLINE_EFFECT_PENDING_DEADLINE": "5",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tokenline", "maintenance", "--url", url],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_leader(url: str, owner_pid: int, newer_than: int = 0) -> ResourceLease:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        lease = _lease(url)
        if (
            lease is not None
            and f"-{owner_pid}-" in lease.owner
            and lease.token > newer_than
            and lease.expires_at > time.time()
        ):
            return lease
        time.sleep(0.1)
    raise AssertionError(f"process {owner_pid} never led (last lease: {_lease(url)})")


def test_two_maintenance_processes_one_leads_the_other_takes_over_when_it_dies(
    url: str, tmp_path: Path
) -> None:
    """Two dedicated maintenance processes: one leads; the other never holds that term;
    killed -9, the leader is succeeded by the other in a newer term."""
    first = _spawn_maintenance(url, tmp_path)
    second: subprocess.Popen[str] | None = None
    try:
        led = _wait_for_leader(url, first.pid)
        second = _spawn_maintenance(url, tmp_path)
        for _ in range(15):  # the second stands every renew interval, and loses
            time.sleep(0.1)
            now = _lease(url)
            assert now is not None
            assert (now.owner, now.token) == (led.owner, led.token)
        first.kill()
        first.communicate(timeout=DEADLINE)
        _wait_for_leader(url, second.pid, newer_than=led.token)
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=DEADLINE)
        assert second.returncode == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
