"""Batches finalising writes: one store round trip for every job that finished meanwhile.

While one batch is in flight, new finishes queue up and go together in the next. Each
row is still fenced by its own token inside the store.
"""

from __future__ import annotations

import asyncio
import contextlib

from .._jobs import Finish
from ..stores.base import Store

__all__ = ["BatchCompleter"]


class BatchCompleter:
    """Collects :class:`Finish` requests and writes them in batches."""

    def __init__(self, store: Store, *, max_batch: int = 500) -> None:
        self._store = store
        self._max_batch = max_batch
        self._pending: list[tuple[Finish, asyncio.Future[bool]]] = []
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the background flusher on the running loop."""
        self._runner = asyncio.create_task(self._run(), name="tokenline-completer")

    async def stop(self) -> None:
        """Flush what is pending, then stop."""
        if self._runner is None:
            return
        while self._pending:
            await self._flush()
        self._runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._runner
        self._runner = None

    async def submit(self, finish: Finish) -> bool:
        """Queue ``finish`` and wait for the store's verdict (True: accepted)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((finish, fut))
        self._wake.set()
        if self._runner is None:
            await self._flush()
        return await fut

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._flush()

    async def _flush(self) -> None:
        batch = self._pending[: self._max_batch]
        del self._pending[: len(batch)]
        if not batch:
            return
        try:
            results = await self._store.jobs_finish(finishes=[f for f, _ in batch])
        except Exception as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), ok in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(ok)
