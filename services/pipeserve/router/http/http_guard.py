"""uvicorn's httptools protocol with the limits a public HTTP edge needs, and the router's server.

uvicorn (httptools) bounds neither how long a client may take to send its
request line and headers nor how large they may grow: llhttp keeps
accumulating a header that never ends, so slowloris connections stay open
forever and a 200 MB unfinished header is 200 MB of router memory.
`GuardedHttpProtocol` adds, per connection:

* a header deadline: a request's line and headers must be complete within
  `header_timeout_s` of the connection's start, or of the end of the previous
  response on that connection; otherwise the client gets a 408 and the
  connection is closed;
* a header size cap: more than `max_header_bytes` received while a request's
  headers are incomplete is a 431 and the connection is closed.

A client gone mid-response (a reset) must not flood the log: asyncio's transport
logs `socket.send() raised exception.` for every write after the first failed one
until the protocol hears of the loss on the loop's next turn, and a response that
writes in a burst (a stream's opening chunks, one per choice: n=64 gave 167 lines)
writes many in that turn. `_WriteGuard` drops writes once the transport is closing
and tells the response at once (its cycle is disconnected, its receive() says
http.disconnect), as connection_lost will a moment later.

So a connection holds at most the cap plus one socket read before its headers
are parsed; its body is bounded by the app (read_json reads at most
MAX_BODY_BYTES, within `body_timeout_s`: 408 otherwise), and uvicorn pauses
reading past its high-water mark. Each refusal is one log line.

`RouterServer` ends every open SSE stream itself (an error event, then
`data: [DONE]`) just before uvicorn's graceful-shutdown deadline cancels the
response tasks, so a drained client never sees a truncated chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipeserve.config import RouterConfig
from pipeserve.obs.ratelimit import RateLimitedLog

log = logging.getLogger("pipeserve.router")

# Streams are ended this long before the graceful-shutdown deadline (at most half of it), so the error
# event and [DONE] are written before uvicorn cancels the response tasks.
STREAM_END_MARGIN_S = 1.0


class GuardedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a header deadline and a header size cap (see the module docstring)."""

    header_timeout_s = 10.0
    max_header_bytes = 65536
    refusals: RateLimitedLog | None = None  # one per server (guarded_protocol): a flood logs O(1) lines

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_headers = True  # the next bytes belong to a request line or headers
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        self.transport = _WriteGuard(transport, self)  # type: ignore[assignment]

    def lost_on_write(self) -> None:
        """A write found the transport closing: the response stops now (connection_lost's part)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.disconnected:
            cycle.disconnected = True
            cycle.message_event.set()  # receive() answers http.disconnect: the stream is cancelled

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # Checked after parsing: one read may hold whole headers and the start of a large body.
        if (
            self._awaiting_headers
            and self._header_bytes > self.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._refuse(431, f"the request line and headers exceed {self.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_headers = True  # what follows is the next (pipelined or keep-alive) request
        self._header_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._awaiting_headers and not self.transport.is_closing():
            self._arm()  # the next request's headers are due within the deadline too

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is being written: a 408 cannot be
            return
        self._refuse(408, f"the request headers did not arrive within {self.header_timeout_s}s")

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        code = "request_timeout" if status == 408 else "request_header_fields_too_large"
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        ).encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        if self.refusals is None:
            log.warning("%d to %s: %s (connection closed)", status, peer, message)
        else:
            self.refusals.warning(status, "%d to %s: %s (connection closed)", status, peer, message)


class _WriteGuard:
    """The transport as uvicorn's protocol and its responses see it: writes once it is closing are
    dropped (see the module docstring); everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedHttpProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._transport.is_closing():
            self._protocol.lost_on_write()
            return
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(config: RouterConfig) -> type[GuardedHttpProtocol]:
    """The protocol class with `config`'s limits (uvicorn instantiates it per connection)."""
    return type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {
            "header_timeout_s": config.header_timeout_s,
            "max_header_bytes": config.max_header_bytes,
            "refusals": RateLimitedLog(log, interval_s=30.0),
        },
    )


class RouterServer(uvicorn.Server):
    """uvicorn.Server that ends the router's streams just before the graceful-shutdown deadline."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        router = getattr(getattr(self.config.app, "state", None), "router", None)
        handle = None
        if timeout is not None and router is not None:
            at = max(0.0, timeout - min(STREAM_END_MARGIN_S, timeout / 2))
            handle = asyncio.get_running_loop().call_later(at, router.end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()


def server_config(app: Any, config: RouterConfig, **options: Any) -> uvicorn.Config:
    """uvicorn's Config for the router: the guarded protocol, keep-alive and shutdown bounds."""
    defaults: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "log_level": "warning",
        "log_config": None,  # uvicorn's lines go through the process's handler (obs/logs.py: text|json)
        "lifespan": "on",
        "http": guarded_protocol(config),
        "timeout_keep_alive": 5,
    }
    return uvicorn.Config(app, **{**defaults, **options})
