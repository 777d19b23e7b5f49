"""``tokenline drill`` as users run it: bad input refused before any worker starts,
machine-readable output, and nothing left running after Ctrl-C."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline.cli import main
from tokenline.drill._fleet import RUN_ENV
from tokenline.drill.runner import Drill

pytestmark = pytest.mark.acceptance


def _drill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenline", "drill", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


#: Set to a value of its own in the environment of one test's drill, and so inherited by
#: every process it starts: the test looks for its own processes only, never those of a
#: drill that another test runs at the same time.
MARK_ENV = "TOKENLINE_TEST_DRILL_MARK"


def _drill_processes(mark: str) -> list[int]:
    """Pids of processes started by the drill run with ``mark`` (both in their
    environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        variables = env.split(b"\0")
        marked = f"{MARK_ENV}={mark}".encode() in variables
        if marked and any(v.startswith(f"{RUN_ENV}=".encode()) for v in variables):
            found.append(int(entry.name))
    return found


def test_an_unknown_scenario_is_refused_with_the_known_names() -> None:
    """A misspelt scenario stops the drill before anything starts, naming the valid ones."""
    result = CliRunner().invoke(main, ["drill", "--scenario", "kill-9"])
    assert result.exit_code == 2
    assert "unknown scenario kill-9" in result.output
    assert "kill9" in result.output


def test_a_postgres_only_scenario_is_refused_on_sqlite() -> None:
    """pg_restart on SQLite is an error, not a silent pass."""
    result = CliRunner().invoke(main, ["drill", "--scenario", "pg_restart"])
    assert result.exit_code == 2
    assert "scenario pg_restart does not apply to sqlite" in result.output


def test_the_periodic_scenarios_are_listed_in_the_help() -> None:
    """``tokenline drill --help`` names the periodic scenarios among the others."""
    result = CliRunner().invoke(main, ["drill", "--help"])
    assert result.exit_code == 0
    for name in ("periodic_kill9_leader", "periodic_sigstop_leader"):
        assert name in result.output


def test_an_unreachable_store_is_refused_before_any_worker_starts() -> None:
    """A URL nobody answers on: a clear error and exit 2, quickly, no worker started."""
    with socket.socket() as sock:  # a port that was just free: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    result = _drill("--url", f"postgresql://postgres@127.0.0.1:{port}/test", "--jobs", "10")
    assert result.returncode == 2, result.stderr
    assert "cannot reach PostgreSQL" in result.stderr
    assert time.monotonic() - started < 30
    assert "workers" not in result.stdout


@pytest.mark.postgres
def test_a_proxy_port_in_use_is_refused_before_any_worker_starts(postgres_server: str) -> None:
    """The per-worker proxies' ports are tried first: one in use is a clear error."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _drill("--url", postgres_server, "--proxy-port", str(port), "--jobs", "10")
    assert result.returncode == 2, result.stderr
    assert "port already in use" in result.stderr


def test_json_output_and_exit_status(tmp_path: Path) -> None:
    """--json prints one object per scenario with its verdict; exit 0 when all held."""
    result = _drill(
        "--scenario", "kill9", "--jobs", "60", "--json", "--url", f"sqlite:///{tmp_path / 'd.db'}"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(result.stdout)
    assert row["scenario"] == "kill9"
    assert row["ok"] is True
    assert row["lost"] == row["duplicate_effects"] == row["stale_writes_accepted"] == 0
    assert row["lease_ttl_seconds"] == 2.0


@pytest.fixture
def no_leftovers() -> Iterator[str]:
    """A mark for the test's drill; after the test, no process of that drill is left."""
    mark = secrets.token_hex(8)
    yield mark
    left = set(_drill_processes(mark))
    for pid in left:  # clean up for the next tests, then fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"drill processes survived: {sorted(left)}"


def test_ctrl_c_leaves_no_worker_or_proxy_running(no_leftovers: str, tmp_path: Path) -> None:
    """SIGINT while workers run (and one is paused): the drill stops every process group
    and exits, leaving no worker behind."""
    out = (tmp_path / "drill.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenline", "drill", "--scenario", "sigstop", "--jobs", "3000",
         "--url", f"sqlite:///{tmp_path / 'c.db'}"],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200", MARK_ENV: no_leftovers},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_drill_processes(no_leftovers)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_drill_processes(no_leftovers)) >= 3, "the workers never started"
        time.sleep(3)  # into the run, likely past the SIGSTOP
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    assert proc.returncode != 0, (tmp_path / "drill.out").read_text()
    assert _drill_processes(no_leftovers) == []


@pytest.mark.postgres
def test_proxy_ports_past_the_last_port_are_refused(postgres_server: str) -> None:
    """--proxy-port 65535 with three workers asks for ports up to 65537: it used to end
    in a traceback once the proxies started."""
    result = CliRunner().invoke(
        main, ["drill", "--url", postgres_server, "--proxy-port", "65535", "--jobs", "10"]
    )
    assert result.exit_code == 2, result.output
    assert "3 workers need ports 65535 to 65537, past the last port, 65535" in result.output


@pytest.mark.postgres
def test_a_proxy_port_in_use_is_refused_on_the_split_topology_too(
    postgres_server: str, redis_server: str
) -> None:
    """The split topology's proxies (in front of Redis) got no trial listen: a port in
    use ended in a traceback after the workers' store was set up."""
    url = f"split:?broker={redis_server}&ledger={postgres_server}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(
            main, ["drill", "--url", url, "--proxy-port", str(port), "--jobs", "10"]
        )
    assert result.exit_code == 2, result.output
    assert f"--proxy-port: cannot listen on port {port}" in result.output


@pytest.mark.postgres
def test_the_split_preflight_leaves_no_scratch_directory(
    postgres_server: str, redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking a split topology's URL built a scratch store whose empty working
    directory was left in the temporary directory, one per run."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    Drill(url=f"split:?broker={redis_server}&ledger={postgres_server}", jobs=10).preflight()
    assert list(tmp_path.iterdir()) == []


def test_a_scratch_directory_that_cannot_be_made_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the scratch directories go cannot take one (here: a file stands there): a
    clear error and exit status 2 before any worker starts, not a traceback."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setattr("tempfile.tempdir", str(blocker))
    result = CliRunner().invoke(main, ["drill", "--scenario", "kill9", "--jobs", "10"])
    assert result.exit_code == 2, result.output
    assert f"cannot create the drill's scratch directories in {str(blocker)!r}" in result.output
    assert "Traceback" not in result.output
