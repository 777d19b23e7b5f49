"""The ``store`` fixture: every contract test runs once per backend.

Backends join by adding a factory to ``BACKENDS``. A backend whose service is missing is
skipped with the reason printed, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline.stores import MemoryStore, Store
from tokenline.stores.sqlite import SQLiteStore


def _memory(clock: FakeClock, tmp_path: Path) -> Store:
    return MemoryStore(clock=clock)


def _sqlite(clock: FakeClock, tmp_path: Path) -> Store:
    return SQLiteStore(f"sqlite:///{tmp_path / 'contract.db'}", clock=clock)


BACKENDS: dict[str, Callable[[FakeClock, Path], Store]] = {
    "memory": _memory,
    "sqlite": _sqlite,
}


@pytest.fixture(params=sorted(BACKENDS))
async def store(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> AsyncIterator[Any]:
    """An open, empty store of each backend, driven by the fake clock."""
    s = BACKENDS[request.param](clock, tmp_path)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def store_pair(
    request: pytest.FixtureRequest, store: Any, clock: FakeClock, tmp_path: Path
) -> AsyncIterator[tuple[Any, Any]]:
    """Two handles on the same data: two connections where the backend has them."""
    if not store.capabilities.multi_process:
        yield store, store
        return
    backend = request.node.callspec.params["store"]
    other = BACKENDS[backend](clock, tmp_path)
    await other.open()
    try:
        yield store, other
    finally:
        await other.close()
