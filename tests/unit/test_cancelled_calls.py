"""A call given up on (a timeout, a Ctrl-C cancelling the caller) must not leave a task
whose error nobody reads: Python reports it on stderr as "Task exception was never
retrieved", which the CLI's Ctrl-C tests see as noise after "interrupted"."""

from __future__ import annotations

import asyncio
import gc
import pathlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tokenline.cli.scale import _read
from tokenline.health import _bounded


async def _fails_when_cancelled(started: asyncio.Event) -> None:
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        # A store call cancelled mid-way may end with an error of its own (a closed
        # connection), not with CancelledError.
        raise RuntimeError("connection closed under the call") from None


def _unretrieved(run: Callable[[asyncio.Event], Awaitable[Any]]) -> list[dict[str, Any]]:
    """Run ``run`` as a task, cancel it once its inner call started, and return what
    the loop's exception handler was told about once everything is collected."""
    reports: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reports.append(ctx))
        started = asyncio.Event()
        outer = asyncio.ensure_future(run(started))
        await started.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        for _ in range(5):  # let a task left behind end, then collect it
            await asyncio.sleep(0)
        del outer
        gc.collect()

    asyncio.run(main())
    return reports


def test_scale_hint_read_cancelled_leaves_no_unretrieved_error() -> None:
    reports = _unretrieved(lambda started: _read(lambda: _fails_when_cancelled(started), 60))
    assert [r["message"] for r in reports] == []


def test_status_probe_cancelled_leaves_no_unretrieved_error() -> None:
    reports = _unretrieved(lambda started: _bounded(_fails_when_cancelled(started), 60))
    assert [r["message"] for r in reports] == []


def test_status_probe_cancelled_cancels_its_call() -> None:
    """asyncio.wait does not cancel what it waits for: a probe whose caller is cancelled
    must not leave its store call running."""
    ended: list[str] = []

    async def call(started: asyncio.Event) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    _unretrieved(lambda started: _bounded(call(started), 60))
    assert ended == ["cancelled"]


def test_src_bounds_calls_without_wait_for() -> None:
    """asyncio.wait_for wraps its call in a task whose error is lost when the caller is
    cancelled (Python 3.11); ``async with asyncio.timeout(...)`` runs it in place."""
    src = pathlib.Path(__file__).resolve().parents[2] / "src" / "tokenline"
    found = [
        f"{path.relative_to(src)}:{n}"
        for path in sorted(src.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"asyncio\.wait_for\(", line)
    ]
    assert found == []
