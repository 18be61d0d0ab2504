"""uvicorn's HTTP protocol with a time limit on a request's headers.

uvicorn closes a keep-alive connection idle between requests (``timeout_keep_alive``) but
waits without end for a request's headers: 500 connections that each sent half a request
line were held open, each a socket and its buffers (issue 30). ``HeaderTimeout`` closes a
connection whose request headers are not complete ``HEADER_TIMEOUT_S`` after it opened, or
after the request began. A body, once the headers are in, is the application's to read (the
service's limit on it is by size, ``service.middleware.BodyLimit``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HEADER_TIMEOUT_S", "HeaderTimeout", "with_header_timeout"]

HEADER_TIMEOUT_S = 10.0
"""What a client gets to send a request's line and headers (a browser or curl: a few ms)."""


class HeaderTimeout(HttpToolsProtocol):
    """``HttpToolsProtocol`` whose connections wait at most ``header_timeout_s`` for the
    headers of each request."""

    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is a request that never began

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the next request on a kept-alive connection

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def with_header_timeout(seconds: float) -> type[HeaderTimeout]:
    """The protocol class with its limit at ``seconds`` (what ``uvicorn.run(http=...)``
    takes)."""
    return type("HeaderTimeout", (HeaderTimeout,), {"header_timeout_s": seconds})
