"""How ``tokenline dashboard`` serves its app: uvicorn, with silent connections closed.

uvicorn closes a keep-alive connection that stays idle after a response, but not one
that never sends a complete request: a client could open connections and send nothing
(or a byte now and then), and each stayed open for as long as it liked, until the
process ran out of file descriptors and the operator's own browser could not connect.
Here a connection must send a complete request head within :data:`REQUEST_HEAD_TIMEOUT`
of opening, or of the end of its last response, and the request's body within
:data:`REQUEST_BODY_TIMEOUT` more, or it is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["REQUEST_BODY_TIMEOUT", "REQUEST_HEAD_TIMEOUT", "server_config"]

#: Seconds a connection has to send a complete request head, from its opening or from
#: the end of its last response. A browser sends one at once; longer than uvicorn's
#: keep-alive timeout (5 s), which closes an idle kept-alive connection first.
REQUEST_HEAD_TIMEOUT = 10.0
#: Seconds more a request whose head arrived has to send the rest of its body. The
#: dashboard's forms are a few hundred bytes: a body still arriving then is a client
#: holding the connection, a byte at a time.
REQUEST_BODY_TIMEOUT = 10.0


class _HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request does not arrive
    complete in time: its head, then its body. A request read whole is left alone,
    however long its response takes."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        # The cycle now: a new request replaces it as soon as its head is read.
        self._head_timer = self.loop.call_later(REQUEST_HEAD_TIMEOUT, self._overdue, self.cycle)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _overdue(self, cycle: Any, *, body: bool = False) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is cycle:
            if not body or cycle.more_body:
                self.transport.close()  # no head yet, or the body is still arriving
            return
        if not body and self.cycle is not None and self.cycle.more_body:
            # A new request's head came, its body has not yet: that has a time too.
            self._head_timer = self.loop.call_later(
                REQUEST_BODY_TIMEOUT, self._body_overdue, self.cycle
            )

    def _body_overdue(self, cycle: Any) -> None:
        self._overdue(cycle, body=True)


def server_config(app: Any) -> uvicorn.Config:
    """The uvicorn configuration ``tokenline dashboard`` serves ``app`` with."""
    return uvicorn.Config(app, log_level="warning", http=_HeadTimeoutProtocol)
