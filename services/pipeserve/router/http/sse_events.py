"""A completion's or chat's stream as server-sent events (OpenAI's chunks, then `[DONE]`).

`sse_events` yields each choice's role chunk, then every event's chunk as the upstream calls
deliver them, the usage chunk when asked, and `[DONE]`. Whatever ends the stream early ends it in
OpenAI's shape: an APIError (a group failed, a deadline) or a router bug becomes an error event
before `[DONE]`; shutdown (`ending` set: RouterServer's drain deadline) ends every open stream with
a 503 error event at once, rather than leaving uvicorn to cancel the responses mid-chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

from pipeserve.router import errors
from pipeserve.router.api.responses import SSE_DONE, Formatter, sse
from pipeserve.router.errors import APIError
from pipeserve.router.upstream.serving import Generation

log = logging.getLogger("pipeserve.router")
T = TypeVar("T")


async def sse_events(
    gen: Generation, fmt: Formatter, include_usage: bool, ending: asyncio.Event
) -> AsyncIterator[str]:
    try:
        for c in gen.choices:
            opening = fmt.role_chunk(c.index, c.result)
            if opening is not None:
                yield sse(opening)
        async for c, ev in unless_ending(gen.events(), ending):
            ended = ev.finish_reason is not None
            if ev.text or ev.tokens or ended or (fmt.return_token_ids and ev.token_ids):
                chunk = fmt.chunk(c.index, ev.text, ev.tokens, ev.finish_reason, ev.token_ids)
                if chunk is not None:  # None: text a tool-call parser holds back
                    yield sse(chunk)
        if include_usage:
            yield sse(fmt.usage_chunk(gen.selected()))
    except APIError as e:
        yield errors.error_event(e)
    except Exception:  # a router bug: end the stream in the error shape, loudly in the log
        log.exception("stream %s failed", fmt.id)
        yield errors.error_event(errors.internal("internal error while streaming"))
    gen.record_trace()
    yield SSE_DONE


async def unless_ending(events: AsyncIterator[T], ending_event: asyncio.Event) -> AsyncIterator[T]:
    """`events`, until `ending_event` is set: then an APIError (503) instead of the next one."""
    ending = asyncio.ensure_future(ending_event.wait())
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait({step, ending}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                raise errors.unavailable(
                    "the server is shutting down: the stream ended at its drain deadline"
                )
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:  # also when the response is closed early (client gone): nothing stays pending
        ending.cancel()
        if step is not None:
            step.cancel()
