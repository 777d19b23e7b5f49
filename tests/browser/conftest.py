"""Browser fixtures: the dashboard served by uvicorn in a thread, driven by Debian's
Chromium through Playwright.

One browser per test module; one store and one server per test (a fresh SQLite store
in ``tmp_path``, see ``dashboard_state``). Chromium is Debian's: see the ``chromium``
fixture of the root conftest.

Screenshots go to ``TOKENLINE_TEST_SCREENSHOTS`` when set (a directory outside the
repository, or a git-ignored one: screenshots are artefacts, never committed), else to
the test's ``tmp_path``; every path written is listed at the end of the run.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dashboard_state import State, populate

TOKEN = "browser-operator-token"
#: Longest a page, a server start or a refresh may take on a slow, shared machine.
DEADLINE = 60.0

_SCREENSHOTS: list[Path] = []


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Any]:
    """A headless Chromium, shared by the tests of one module."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            yield b
        finally:
            b.close()


class Served:
    """A dashboard running in a thread on a free loopback port."""

    def __init__(self, state: State, token: str | None) -> None:
        import uvicorn

        from tokenline.dashboard import create_app

        self.state = state
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        web = create_app(state.app, operator_token=token, bind=("127.0.0.1", port))
        config = uvicorn.Config(web, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + DEADLINE
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(DEADLINE)
        self.sock.close()


@pytest.fixture
def state(tmp_path: Path) -> State:
    """A store with real jobs, workers and leases, in an incident: a worker fenced, a
    breaker open, a queue paused."""
    return populate(tmp_path, faulty=True)


@pytest.fixture
def served(state: State) -> Iterator[Served]:
    """The dashboard of ``state``'s store, actions enabled with :data:`TOKEN`."""
    with Served(state, TOKEN) as s:
        yield s


@pytest.fixture
def page(browser: Any, served: Served) -> Iterator[Any]:
    """A fresh browser page (its own context: no cookies shared between tests)."""
    context = browser.new_context(base_url=served.url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(DEADLINE * 1000)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    """Where screenshots go: ``TOKENLINE_TEST_SCREENSHOTS``, else ``tmp_path``."""
    chosen = os.environ.get("TOKENLINE_TEST_SCREENSHOTS")
    where = Path(chosen) if chosen else tmp_path / "screenshots"
    where.mkdir(parents=True, exist_ok=True)
    return where


def keep_screenshot(path: Path) -> None:
    """Name ``path`` in the run's summary."""
    _SCREENSHOTS.append(path)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List the screenshots the browser tests wrote."""
    if _SCREENSHOTS:
        terminalreporter.section("dashboard screenshots")
        for path in _SCREENSHOTS:
            terminalreporter.write_line(str(path))
