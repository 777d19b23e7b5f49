"""``tokenline dashboard``: the command serves the app, read-only without a token, and
refuses a malformed --bind before starting anything."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
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


@pytest.mark.parametrize(
    ("token", "says"),
    [
        ("", "set but blank"),
        ("   ", "set but blank"),
        ("\t\n", "set but blank"),
        ("short", "5 characters long"),
        (" a-long-enough-secret ", "whitespace"),
    ],
)
def test_a_blank_or_weak_token_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, token: str, says: str
) -> None:
    """TOKENLINE_DASHBOARD_TOKEN set but blank, short or padded stops the command
    before it serves anything (exit 2), saying why; actions are never enabled by it."""
    import uvicorn

    served: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: served.append(a))
    monkeypatch.setenv("TOKENLINE_DASHBOARD_TOKEN", token)
    result = CliRunner().invoke(main, ["dashboard", "--url", "memory://"])
    assert result.exit_code == 2, result.output
    assert "TOKENLINE_DASHBOARD_TOKEN" in result.output
    assert says in result.output
    assert served == []


@pytest.mark.parametrize(
    ("bind", "url"),
    [
        ("[::1]:8080", "http://[::1]:8080/"),
        ("::1:8080", "http://[::1]:8080/"),
        ("[::]:9000", "http://[::]:9000/"),
        ("127.0.0.1:8080", "http://127.0.0.1:8080/"),
    ],
)
def test_the_address_printed_is_a_url(monkeypatch: pytest.MonkeyPatch, bind: str, url: str) -> None:
    """The address the command prints can be pasted in a browser: an IPv6 host in
    brackets; the socket uvicorn serves is bound to the bare address."""
    import uvicorn

    listened: list[tuple[str, int]] = []
    served: list[object] = []

    class Listening:
        """Stands for the bound socket: the ports above may be taken on this machine."""

        def __init__(self, host: str, port: int) -> None:
            listened.append((host, port))
            self.address = (host, port)

        def getsockname(self) -> tuple[str, int]:
            return self.address

        def close(self) -> None:
            pass

    monkeypatch.setattr(importlib.import_module("tokenline.cli.dashboard"), "_listen", Listening)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.append(sockets))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's handlers
    monkeypatch.delenv("TOKENLINE_DASHBOARD_TOKEN", raising=False)
    result = CliRunner().invoke(main, ["dashboard", "--url", "memory://", "--bind", bind])
    assert result.exit_code == 0, result.output
    assert f"tokenline dashboard on {url} :" in result.output
    host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
    assert listened == [(host.strip("[]"), int(port))]
    assert len(served) == 1


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


class Running:
    """``tokenline dashboard`` started by the real CLI, its output in ``out``."""

    def __init__(self, proc: subprocess.Popen[bytes], out: Path, port: int) -> None:
        self.proc, self.out, self.port = proc, out, port

    def get(self, path: str, host: str | None = None) -> httpx.Response:
        """``path`` fetched (naming ``host`` in the Host header, when given) once the
        server answers (it may still be starting)."""
        headers = {"host": host} if host else {}
        deadline = time.monotonic() + DEADLINE
        while True:
            assert self.proc.poll() is None, self.out.read_text()
            assert time.monotonic() < deadline, self.out.read_text()
            try:
                url = f"http://127.0.0.1:{self.port}{path}"
                return httpx.get(url, headers=headers, timeout=10)
            except httpx.TransportError:
                time.sleep(0.1)


@contextlib.contextmanager
def running(
    tmp_path: Path,
    *args: str,
    token: str | None = None,
    env: dict[str, str] | None = None,
    url: str | None = None,
) -> Iterator[Running]:
    """The dashboard of a populated store (or of ``url``) on a free port, stopped by
    SIGTERM (it must exit 0) when the block ends."""
    url = populate(tmp_path).url if url is None else url
    port = _free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_DASHBOARD")}
    if token:
        environ["TOKENLINE_DASHBOARD_TOKEN"] = token
    environ |= env or {}
    cmd = [sys.executable, "-m", "tokenline", "dashboard", "--url", url,
           "--bind", f"127.0.0.1:{port}", *args]  # fmt: skip
    out = tmp_path / "out.log"
    with out.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=environ, stdout=fh, stderr=fh)
    try:
        yield Running(proc, out, port)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(DEADLINE)


@pytest.mark.parametrize("token", [None, "t0ken-of-the-operator"])
def test_the_command_serves_the_dashboard_until_sigterm(tmp_path: Path, token: str | None) -> None:
    """Started by the real CLI, the dashboard answers on --bind, says whether actions
    are enabled, and exits 0 on SIGTERM."""
    with running(tmp_path, token=token) as dash:
        page = dash.get("/workers/w-busy")
        assert page.status_code == 200
        assert "Jobs it holds" in page.text
        assert ("read-only" in page.text) is (token is None)
    said = dash.out.read_text()
    assert ("actions enabled" in said) is (token is not None)
    assert token is None or token not in said  # the secret is never printed


@pytest.mark.parametrize("how", ["option", "environment"])
def test_the_command_answers_only_to_its_own_and_allowed_hosts(tmp_path: Path, how: str) -> None:
    """The real server refuses (421) a request naming another host, as a DNS rebinding
    page sends it, and answers to its bind address, localhost and each allowed host."""
    args = ("--allowed-host", "dash.test", "--allowed-host", "other.test:81")
    env = {"TOKENLINE_DASHBOARD_ALLOWED_HOSTS": "dash.test other.test:81"}
    with running(
        tmp_path, *(args if how == "option" else ()), env=env if how != "option" else None
    ) as dash:
        refused = dash.get("/", host=f"rebind.attacker.example:{dash.port}")
        assert refused.status_code == 421
        assert "does not answer to host" in refused.text
        assert dash.get("/", host="other.test:82").status_code == 421
        for host in (f"127.0.0.1:{dash.port}", f"localhost:{dash.port}", "dash.test",
                     "other.test:81"):  # fmt: skip
            assert dash.get("/leases", host=host).status_code == 200, host


def test_a_malformed_allowed_host_is_refused() -> None:
    """--allowed-host must be NAME or NAME:PORT: a wildcard or a URL exits 2."""
    for bad in ("*.example.com", "http://dash.test"):
        result = CliRunner().invoke(
            main, ["dashboard", "--url", "memory://", "--allowed-host", bad]
        )
        assert result.exit_code == 2
        assert "expected NAME or NAME:PORT" in result.output


def test_a_port_in_use_is_an_error_before_anything_says_started(tmp_path: Path) -> None:
    """The dashboard printed "tokenline dashboard on …" and logged "started" before
    uvicorn failed to bind. It now binds first: one error line naming the address,
    exit status 2, and no word of a start."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "tokenline", "dashboard", "--url", "memory://",
             "--bind", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
        )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    assert "started" not in out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_dashboard_starts_while_its_postgres_server_does_not_answer(
    tmp_path: Path, postgres_server: str, absent_schema: str
) -> None:
    """A dashboard rides out an outage: started while its server is silent, it serves
    and says the store does not answer, where a one-shot command fails at once."""
    from tokenline.drill import ThreadedFaultProxy

    with ThreadedFaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
        proxy.set_faults(blackhole=True)
        via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        url = f"{via}?schema={absent_schema}&connect_timeout=2"
        with running(tmp_path, "--timeout", "3", url=url) as dash:
            page = dash.get("/")
            assert "did not accept a connection" in page.text, page.text
    assert "tokenline dashboard on" in dash.out.read_text()
