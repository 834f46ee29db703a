"""The router's request edge: who may ask (auth), what was sent (the body), how much runs (admission),
and a client that goes away.

* `check_auth`: `Authorization: Bearer K` compared as bytes in constant time (a header is any latin-1
  bytes; `hmac.compare_digest` refuses non-ASCII `str`), 401 otherwise.
* `read_json`: the body, read at most MAX_BODY_BYTES far (413) and within `body_timeout_s` (408,
  connection closed: the rest is never read); a client gone mid-body is ClientGone (499); JSON that
  Python refuses (an integer literal over its 4,300-digit limit, nesting too deep) is a 400 like any
  bad JSON. Big bodies decode in a worker thread.
* `Admission`: a batch of N prompts opens N Generate calls, so it takes N of `max_concurrency`; a
  batch that could never fit is a 400, one that does not fit now a 429. A `Slot` is held until the
  response has ended and released exactly once.
* `until_disconnect` / `SSEResponse`: work is cancelled when the client disconnects; a streaming
  response releases what it holds even when cancelled before it started.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from prometheus_client import Gauge
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from pipeserve.router import errors
from pipeserve.router.errors import APIError

MAX_BODY_BYTES = 16 * 2**20  # far above any prompt the context can hold (and JSON token-id lists)
BIG_BODY_BYTES = 2**20  # bodies above this are decoded off the event loop
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def check_auth(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip().encode("latin-1")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, api_key.encode()):
        raise errors.unauthorized()


def _decode_json(raw: bytearray) -> Any:
    return json.loads(raw.decode("utf-8"))  # RFC 8259: a JSON body is UTF-8


async def read_json(request: Request, timeout_s: float) -> Any:
    """The decoded JSON body; see the module docstring for the limits."""
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):  # a body shorter than its Content-Length ends here
            async for part in request.stream():
                raw += part
                if len(raw) > MAX_BODY_BYTES:
                    raise errors.too_large(f"the request body exceeds {MAX_BODY_BYTES} bytes")
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s}s",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body is never read
        ) from None
    except ClientDisconnect:
        raise ClientGone(f"after {len(raw)} bytes of its body") from None
    try:
        if len(raw) <= BIG_BODY_BYTES:
            return _decode_json(raw)
        # A big body decodes in a worker thread: the C decoder holds the GIL, but in two short
        # calls (UTF-8, then JSON; json.loads on bytes takes a slower path) the loop runs between.
        return await asyncio.to_thread(_decode_json, raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError included
        raise errors.invalid(None, f"the request body is not valid JSON: {str(e)[:200]}") from None


class Admission:
    """Prompts in flight at this router, against `limit` (max_concurrency); mirrored in `gauge`."""

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.gauge = gauge
        self.in_flight = 0

    def acquire(self, prompts: int = 1, param: str = "prompt") -> Slot:
        """A slot for `prompts` upstream calls (prompts × best_of), or an APIError: 400 (naming
        `param`) if it can never fit, 429 if not now."""
        if prompts > self.limit:
            raise errors.invalid(
                param,
                f"the request is too large: {prompts} generations (prompts × best_of) exceed this "
                f"server's limit of {self.limit} per request (max_concurrency)",
            )
        if self.in_flight + prompts > self.limit:
            raise errors.too_many_requests(
                f"the router has {self.in_flight} prompts in flight and this request adds {prompts} "
                f"(max_concurrency {self.limit})"
            )
        self._add(prompts)
        return Slot(self, prompts)

    def _add(self, n: int) -> None:
        self.in_flight += n
        self.gauge.set(self.in_flight)


class Slot:
    """`prompts` units of an Admission, held until released (once; release is idempotent)."""

    def __init__(self, admission: Admission, prompts: int) -> None:
        self.admission = admission
        self.prompts = prompts
        self.handed_off = False  # a streaming response owns it now
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.admission._add(-self.prompts)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (and `work` cancelled) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watch.cancel()
        task.cancel()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `cleanup` however it ends (even cancelled before it began)."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()
