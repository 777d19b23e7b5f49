"""``tokenline scale-hint`` against real stores, healthy and failing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from tokenline import App
from tokenline._jobs import JobState, WorkerRecord
from tokenline.cli import main
from tokenline.cli.scale import ScaleHinter
from tokenline.drill.storefaults import RoleFaults, StoreFaults, write_fault_file
from tokenline.stores import store_from_url

HERE = Path(__file__).parent


def _seed(url: str, jobs: int, *, busy_worker: bool = False) -> None:
    async def seed() -> None:
        store = store_from_url(url)
        await store.open()
        try:
            app = App(url)
            app.task(name="t")(lambda ctx: None)
            await store.jobs_enqueue(jobs=[app.build_job("t", []) for _ in range(jobs)])
            if busy_worker:
                rec = WorkerRecord(
                    id="w-1", host="h", pid=1, queues=("default",), concurrency=1,
                    state="processing", token=0, started_at=0.0, heartbeat_at=0.0,
                    expires_at=0.0,
                )  # fmt: skip
                reg = await store.worker_register(record=rec, ttl=600)
                await store.worker_heartbeat(
                    worker_id="w-1", token=reg.token, state="processing", in_flight=1, ttl=600
                )
        finally:
            await store.close()

    asyncio.run(seed())


def hint(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(main, ["scale-hint", "--json", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_jobs_waiting_and_no_worker_asks_for_workers(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    _seed(url, 5)
    out = hint("--url", url, "--interval", "0")
    assert out["advice"] == "add"
    assert out["backlog_after"] == 5
    assert out["workers"] == 0


def _seed_delayed(url: str, *, due: int, later: int) -> None:
    """``due`` jobs delayed by 0.2 s, waited out so that they are runnable but still
    stored as scheduled, and ``later`` jobs delayed by an hour."""

    async def seed() -> None:
        store = store_from_url(url)
        await store.open()
        try:
            app = App(url)
            app.task(name="t")(lambda ctx: None)
            await store.jobs_enqueue(
                jobs=[app.build_job("t", [], delay=0.2) for _ in range(due)]
                + [app.build_job("t", [], delay=3600) for _ in range(later)]
            )
            await asyncio.sleep(0.4)
            scheduled = await store.jobs_list(state=JobState.SCHEDULED)
            assert len(scheduled) == due + later  # the store has not moved them
        finally:
            await store.close()

    asyncio.run(seed())


def test_scheduled_jobs_whose_time_came_are_backlog(tmp_path: Path) -> None:
    """A delayed job (or a due retry) whose run_at has passed is stored as scheduled
    until a worker claims it: scale-hint counted only stored-queued jobs, and with such
    jobs waiting and no worker alive said "enough: backlog 0 → 0". They are runnable,
    so they are backlog; jobs whose time has not come are not."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    _seed_delayed(url, due=3, later=2)
    out = hint("--url", url, "--interval", "0")
    assert out["advice"] == "add", out
    assert out["backlog_after"] == 3
    assert out["oldest_ready_age"] is not None


def test_the_exporter_hint_counts_scheduled_jobs_whose_time_came(tmp_path: Path) -> None:
    """The exporter's /scale-hint (ScaleHinter) reads the same runnable backlog."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    _seed_delayed(url, due=2, later=1)
    status, body, _ = ScaleHinter(App(url).open_store, min_interval=0.0).answer()
    assert status == 200
    out = json.loads(body)
    assert (out["advice"], out["backlog_after"]) == ("add", 2), out


def test_a_steady_backlog_with_a_busy_worker_is_enough(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    _seed(url, 5, busy_worker=True)
    out = hint("--url", url, "--interval", "0.2")
    assert out["advice"] == "enough", out
    assert out["workers_busy"] == 1


def test_an_open_breaker_holds(tmp_path: Path) -> None:
    """A dependency's open-breaker lease held in the store: hold, naming it."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    _seed(url, 5)

    async def trip() -> None:
        store = store_from_url(url)
        await store.open()
        try:
            got = await store.resource_lease_acquire(
                resource="tokenline:breaker:payments-api", owner="w-9", ttl=600
            )
            assert got is not None
        finally:
            await store.close()

    asyncio.run(trip())
    out = hint("--url", url, "--interval", "0")
    assert out["advice"] == "hold"
    assert out["open_dependencies"] == ["payments-api"]


def test_a_failing_lease_channel_holds(tmp_path: Path) -> None:
    """The leases role failing (the drill's fault store): hold, naming the channel."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    _seed(url, 5)
    faults = tmp_path / "faults.json"
    write_fault_file(faults, StoreFaults(leases=RoleFaults(error=True)))
    env = {
        **os.environ,
        "PYTHONPATH": str(HERE),
        "STATUSFAULTAPP_URL": url,
        "STATUSFAULTAPP_FAULT_FILE": str(faults),
    }
    env.pop("TOKENLINE_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "tokenline", "scale-hint", "--app", "statusfaultapp:app",
         "--interval", "0", "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["advice"] == "hold"
    assert "leases" in out["failing_channels"]
    assert "broker" not in out["failing_channels"]


def test_ctrl_c_exits_130(tmp_path: Path) -> None:
    """Ctrl-C during scale-hint's look at the backlog exited as a plain failure (or
    with a hint it had not finished taking); it exits 130, as a process ended by SIGINT
    is reported, and prints no advice."""
    url = f"sqlite:///{tmp_path / 'ctrl-c.db'}"
    assert CliRunner().invoke(main, ["migrate", "--url", url]).exit_code == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenline", "scale-hint", "--url", url, "--interval", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Interrupt once the process is in its first look, which holds the store's file
        # open (Linux's /proc says so); a look missed (a loaded machine) leaves it in the
        # wait between its two looks, with the store closed, when the loop gives up.
        db = str(tmp_path / "ctrl-c.db")
        fds = Path(f"/proc/{proc.pid}/fd")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) == db for fd in fds.iterdir()):
                    break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    assert out == ""
    assert err.strip() == "interrupted"
