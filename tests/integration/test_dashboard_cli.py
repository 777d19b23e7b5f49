"""``tokenline dashboard``: the command serves the app, read-only without a token, and
refuses a malformed --bind before starting anything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from dashboard_state import populate
from tokenline.cli import main

DEADLINE = 60.0


@pytest.mark.parametrize("bind", ["8080", "localhost:", "127.0.0.1:http", ":80", "h:70000"])
def test_a_malformed_bind_is_refused(bind: str) -> None:
    """--bind must be HOST:PORT; anything else exits 2 naming the value."""
    result = CliRunner().invoke(main, ["dashboard", "--url", "memory://", "--bind", bind])
    assert result.exit_code == 2
    assert "expected HOST:PORT" in result.output
    assert repr(bind) in result.output


def test_a_missing_extra_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the dashboard's dependencies the command says which extra to install."""
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    result = CliRunner().invoke(main, ["dashboard", "--url", "memory://"])
    assert result.exit_code == 1
    assert "pip install 'tokenline[dashboard]'" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("token", [None, "t0ken"])
def test_the_command_serves_the_dashboard_until_sigterm(tmp_path: Path, token: str | None) -> None:
    """Started by the real CLI, the dashboard answers on --bind, says whether actions
    are enabled, and exits 0 on SIGTERM."""
    state = populate(tmp_path)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "TOKENLINE_DASHBOARD_TOKEN"}
    if token:
        env["TOKENLINE_DASHBOARD_TOKEN"] = token
    cmd = [sys.executable, "-m", "tokenline", "dashboard", "--url", state.url,
           "--bind", f"127.0.0.1:{port}"]  # fmt: skip
    out = tmp_path / "out.log"
    with out.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=fh)
    try:
        deadline = time.monotonic() + DEADLINE
        page = None
        while page is None:
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/workers/w-busy", timeout=10)
            except httpx.TransportError:
                time.sleep(0.1)
        assert page.status_code == 200
        assert "Jobs it holds" in page.text
        assert ("read-only" in page.text) is (token is None)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(DEADLINE)
    said = out.read_text()
    assert ("actions enabled" in said) is (token is not None)
    assert token is None or token not in said  # the secret is never printed
