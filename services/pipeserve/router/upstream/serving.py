"""One generation request: its choices, their upstream streams, and how they end.

A `Choice` is one prompt's Generate call once open (router/upstream/upstream.py picked its group,
with the retry rule, and read its first message), fed token by token through a TextStream
(detokenizer + stop strings; `decode` is the tokenizer's, keeping the tags a chat parser reads).
A stop string ends the choice at the token that completed it and cancels the
upstream call at once (stage 0 aborts the request and frees its blocks).

A `Generation` is the request: its choices, all open (router/upstream/fanout.py opens them, so
any failure before the first token, after the retry rule, is still an ordinary HTTP error), run
concurrently. `events()` merges the choices' events; `results()` runs them to the end. `close()` is
synchronous and idempotent: it cancels every task and upstream call, so it is
safe from a `finally` running under cancellation (client disconnect).

Invariant: every upstream call of a Generation's choices is cancelled or finished once `close()`
has returned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pipeserve.detokenize import TextStream
from pipeserve.router import errors
from pipeserve.router.api.results import ChoiceResult, TokenLP, select
from pipeserve.router.errors import APIError
from pipeserve.router.upstream.fanout import Planned
from pipeserve.router.upstream.generate import Calls, GenerateStream, UpstreamFailure
from pipeserve.router.upstream.trace import RequestAttributes
from pipeserve.rpc import generation_pb2 as pb

log = logging.getLogger("pipeserve.router")


@dataclass
class ChoiceEvent:
    text: str
    tokens: list[TokenLP]
    finish_reason: str | None
    token_ids: list[int]


class Choice:
    """One open Generate call (`stream`, `first`: its first message) of the fan-out's `planned`."""

    def __init__(
        self,
        calls: Calls,
        decode: Callable[[list[int]], str],
        planned: Planned,
        stream: GenerateStream,
        first: pb.GenerateResponse,
        arrival: float,
    ) -> None:
        params, ids = planned.params, planned.prompt_ids
        self.calls = calls
        self.index = planned.index
        self.prompt_ids = ids
        self.request_id = planned.request_id
        self.arrival = arrival
        self.keep_logprobs = params.logprobs is not None
        self.text = TextStream(decode, params.stop, params.min_tokens)
        self.result = ChoiceResult(
            self.index, prompt_tokens=len(ids), prompt_token_ids=list(ids), prompt_text=planned.prompt_text
        )
        self._stream: GenerateStream | None = stream
        self._first: pb.GenerateResponse | None = first
        self.group, self.retries = stream.group, stream.retries  # where it runs (traces)
        self._last_at: float | None = None
        self.counts_prompt = planned.counts_prompt  # an n > 1 sibling's prompt is counted once
        self.drop_output = planned.drop_output  # echo with max_tokens 0: the one token is not returned
        self.result.prompt_scores = [
            (p.logprob, p.rank, [(t.token_id, t.logprob) for t in p.top]) for p in first.prompt_logprobs
        ]
        m = calls.metrics
        m.ttft.observe(time.monotonic() - arrival)
        if self.counts_prompt:
            m.prompt_tokens.inc(len(ids))

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """The choice's events up to the one with finish_reason; raises APIError if the stream fails."""
        msg, self._first = self._first, None
        try:
            while msg is not None:
                event = self._consume(msg)
                yield event
                if event.finish_reason is not None or self._stream is None:
                    return
                try:
                    msg = await self._stream.next()
                except UpstreamFailure as f:
                    raise self.calls.failed_mid_stream(f, self.request_id) from None
        finally:
            self.close()

    def _consume(self, msg: pb.GenerateResponse) -> ChoiceEvent:
        now = time.monotonic()
        m = self.calls.metrics
        n = len(msg.token_ids)
        if self._last_at is not None and n:
            gap = (now - self._last_at) / n
            for _ in range(n):
                m.itl.observe(gap)
        self._last_at = now
        self.result.cached_tokens = max(self.result.cached_tokens, msg.cached_tokens)
        parts: list[str] = []
        tokens: list[TokenLP] = []
        finish: str | None = None
        used = 0
        if self.drop_output:  # echo with max_tokens 0: the prompt alone, finished by "length"
            if msg.finish_reason:
                self.result.finish_reason = "length"
                self.close()
            return ChoiceEvent("", [], "length" if msg.finish_reason else None, [])
        for k, tid in enumerate(msg.token_ids):
            offset = len(self.text.text)
            parts.append(self.text.push(tid))
            used += 1
            if self.keep_logprobs and k < len(msg.logprobs):
                lp = msg.logprobs[k]
                tokens.append(TokenLP(tid, lp.logprob, [(t.token_id, t.logprob) for t in lp.top], offset))
            if self.text.stopped:
                finish = "stop"
                break
        if finish is None and msg.finish_reason:
            parts.append(self.text.finish())
            finish = msg.finish_reason
        m.generation_tokens.inc(used)
        r = self.result
        r.completion_tokens += used
        ids = list(msg.token_ids[:used])
        r.token_ids.extend(ids)
        if self.keep_logprobs:
            r.tokens.extend(tokens)
        if finish is not None:
            r.text, r.finish_reason = self.text.text, finish
            m.e2e.observe(now - self.arrival)
            self.close()  # a stop string: cancel now; stage 0 aborts the request and frees its blocks
        return ChoiceEvent("".join(parts), tokens, finish, ids)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


_DONE = object()


class Generation:
    """`families`: per prompt, its n (or best_of) open candidates, leader first
    (router/upstream/fanout.py); `n`: choices returned per prompt."""

    def __init__(
        self,
        families: list[list[Choice]],
        attributes: RequestAttributes | None = None,
        n: int = 1,
    ) -> None:
        self.families = families
        self.choices = [c for f in families for c in f]
        self.n = n
        self.attributes = attributes  # the request span's usage attributes, set once on close()
        self._tasks: list[asyncio.Task] = []

    def selected(self) -> list[ChoiceResult]:
        """The results returned to the client (best_of's best n), usage counted as vLLM does."""
        return select([[c.result for c in f] for f in self.families], self.n)

    async def events(self) -> AsyncIterator[tuple[Choice, ChoiceEvent]]:
        if len(self.choices) == 1:
            c = self.choices[0]
            async for event in c.events():
                yield c, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for event in c.events():
                    queue.put_nowait((c, event))
                queue.put_nowait((c, _DONE))
            except APIError as e:
                queue.put_nowait((c, e))
            except Exception:  # a router bug must end this stream with an error, not hang it
                log.exception("choice %d of %s failed", c.index, c.request_id)
                queue.put_nowait((c, errors.internal("internal error while streaming")))

        self._tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        left = len(self.choices)
        while left:
            c, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield c, item

    async def results(self) -> list[ChoiceResult]:
        async for _ in self.events():
            pass
        return self.selected()

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for c in self.choices:
            c.close()
        self.record_trace()

    def record_trace(self) -> None:
        """Usage, finish reasons and groups onto the request's span (once; a no-op untraced). A stream
        calls it before its last event: its cleanup may run after the HTTP span has ended."""
        if self.attributes is not None:
            cs = self.choices
            groups = [c.group for c in cs if c.group is not None]
            self.attributes.ended(self.selected(), groups, sum(c.retries for c in cs))
