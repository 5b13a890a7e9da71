"""A request-head read timeout for uvicorn, which has none of its own (slowloris defence).

uvicorn's keep-alive timer is cancelled by any byte received, so a client that sends a request head a few
bytes at a time holds its connection forever. The protocol below starts a timer when a connection opens and
again when a response completes, stops it once a request head (line and headers) has been parsed, and closes
the connection when it fires (with 408 if part of a head had arrived). Slow bodies are bounded separately by
the body size limit.
"""

from __future__ import annotations

import asyncio

_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


def with_header_timeout(base: type, timeout_s: float) -> type:
    """A subclass of a uvicorn HTTP protocol class (h11 or httptools) that enforces the head timeout."""

    class HeaderTimeoutProtocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm(None)

        def _arm(self, previous_cycle) -> None:
            """Wait for a head that is not `previous_cycle`'s."""
            self._waited_cycle, self._head_bytes = previous_cycle, False
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def data_received(self, data: bytes) -> None:
            if self._head_timer is not None:
                self._head_bytes = True
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not None and self.cycle is not self._waited_cycle:
                self._disarm()  # a new request's head has been parsed: its handler has the connection now

        def on_response_complete(self) -> None:
            done = self.cycle
            super().on_response_complete()
            if self.cycle is done and self._head_timer is None and not self.transport.is_closing():
                self._arm(done)  # waiting for the next request on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self._head_bytes:  # part of a head arrived: say why (an idle connection is just closed)
                self.transport.write(_TIMEOUT_408)
            self.transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
