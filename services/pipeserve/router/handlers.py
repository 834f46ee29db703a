"""The router's request handling: auth, admission, tokenization, responses, health.

Order of checks on a generation request (first failure answers):
  401 bad/missing API key -> 400 malformed body or invalid field -> 404 unknown
  model -> 429 `max_concurrency` requests already in flight here -> 503 no
  ready group -> 400 prompt empty / too long / out of vocabulary -> upstream.
A request holds its concurrency slot until its response has ended: blocking
ones until the body is built, streaming ones until the last SSE event or the
client's disconnect (SSEResponse's cleanup, which runs even when the stream
is cancelled before it started).

Streaming answers with SSE only once every choice has its first token, so a
request that fails before then (after the retry rule) gets a plain HTTP
error; after that a failure is an error event followed by `[DONE]`.
A client that disconnects cancels its upstream calls, streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from pipeserve.config import RouterConfig
from pipeserve.errors import InvalidRequestError
from pipeserve.router import errors
from pipeserve.router.errors import APIError
from pipeserve.router.metrics import RouterMetrics
from pipeserve.router.protocol import parse_chat, parse_completion
from pipeserve.router.replicas import ReplicaSet
from pipeserve.router.responses import SSE_DONE, Formatter, sse
from pipeserve.router.serving import Choice, Generation
from pipeserve.router.upstream import Upstream
from pipeserve.sampling_params import SamplingParams, check_prompt, resolve_max_tokens
from pipeserve.tokenizer import TokenizerAssets

MAX_BODY_BYTES = 16 * 2**20  # far above any prompt the context can hold (and JSON token-id lists)
BIG_BODY_BYTES = 2**20  # bodies above this are decoded off the event loop
log = logging.getLogger("pipeserve.router")
T = TypeVar("T")
PROBE_TEXT = "Hello"


def _decode_json(raw: bytearray) -> Any:
    return json.loads(raw.decode("utf-8"))  # RFC 8259: a JSON body is UTF-8


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


class SSEResponse(StreamingResponse):
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


class Slot:
    """`prompts` units of max_concurrency, held until released (once; release is idempotent)."""

    def __init__(self, router: Router, prompts: int = 1) -> None:
        self.router = router
        self.prompts = prompts
        self.handed_off = False  # a streaming response owns it now
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.router.in_flight -= self.prompts
            self.router.metrics.in_flight.set(self.router.in_flight)


class Router:
    def __init__(self, config: RouterConfig, replicas: ReplicaSet, registry: CollectorRegistry) -> None:
        self.config = config
        self.replicas = replicas
        self.registry = registry
        self.tok = TokenizerAssets.load(config.model, config.chat_template)
        # Tokenization and chat rendering run here, off the event loop (encode releases the GIL).
        self.tok_pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="pipeserve-tokenize")
        self.metrics = RouterMetrics(registry)
        self.upstream = Upstream(replicas, config, self.metrics)
        self.in_flight = 0
        self.created = int(time.time())
        self._probe_lock = asyncio.Lock()
        self._ending = asyncio.Event()  # shutdown: open streams end now (end_streams)

    # --- admission -----------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Compared as bytes: compare_digest refuses non-ASCII str, and a header is any latin-1 bytes.
        sent = token.strip().encode("latin-1")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, self.config.api_key.encode()):
            raise errors.unauthorized()

    async def read_json(self, request: Request) -> Any:
        """The JSON body, read at most MAX_BODY_BYTES far (413) and within body_timeout_s (408).

        A client that disconnects mid-body is ClientGone (499); JSON that Python refuses to decode
        (an integer literal over its 4,300-digit limit, nesting too deep) is a 400 like any bad JSON.
        """
        raw = bytearray()
        timeout = self.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):  # a body shorter than its Content-Length ends here
                async for part in request.stream():
                    raw += part
                    if len(raw) > MAX_BODY_BYTES:
                        raise errors.too_large(f"the request body exceeds {MAX_BODY_BYTES} bytes")
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {timeout}s",
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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise errors.model_not_found(model)

    def acquire_slot(self, prompts: int = 1) -> Slot:
        """Slots for `prompts` upstream calls: a batch of N prompts opens N Generate calls and takes N.

        A batch larger than max_concurrency could never be admitted: 400 (retrying cannot help, as
        OpenAI answers a prompt list over its limit); one that does not fit now: 429.
        """
        limit = self.config.max_concurrency
        if prompts > limit:
            raise errors.invalid(
                "prompt", f"a batch of {prompts} prompts exceeds this server's limit of {limit} per request"
            )
        if self.in_flight + prompts > limit:
            raise errors.too_many_requests(
                f"the router has {self.in_flight} prompts in flight and this request adds {prompts} "
                f"(max_concurrency {limit})"
            )
        self.in_flight += prompts
        self.metrics.in_flight.set(self.in_flight)
        return Slot(self, prompts)

    def limits(self) -> tuple[int, int]:
        limits = self.replicas.limits()
        if not self.replicas.ready_groups() or limits is None:
            raise errors.unavailable("no pipeline group is ready")
        return limits

    # --- generation ----------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_auth(request)
        req = parse_completion(await self.read_json(request))
        self.check_model(req.model)
        slot = self.acquire_slot(len(req.prompts))
        try:
            max_len, vocab = self.limits()
            ids = await self._off_loop(
                lambda: [
                    self.tok.encode_prompt(p, req.add_special_tokens, max_len, "prompt")
                    if isinstance(p, str)
                    else p
                    for p in req.prompts
                ]
            )
            fmt = Formatter(
                False,
                f"cmpl-{uuid.uuid4().hex}",
                self.config.model_name,
                self.tok,
                req.params.logprobs is not None,
                req.return_token_ids,
            )
            params = [
                self._resolve(x, req.params, "prompt", req.max_tokens_param, max_len, vocab) for x in ids
            ]
            return await self._generate(
                request, fmt, ids, params, req.stream, req.include_usage, slot, arrival
            )
        finally:
            if not slot.handed_off:
                slot.release()

    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_auth(request)
        req = parse_chat(await self.read_json(request))
        self.check_model(req.model)
        slot = self.acquire_slot()
        try:
            max_len, vocab = self.limits()
            ids = await self._off_loop(
                lambda: self.tok.encode_prompt(
                    self.tok.render_chat(req.messages), req.add_special_tokens, max_len, "messages"
                )
            )
            params = self._resolve(ids, req.params, "messages", req.max_tokens_param, max_len, vocab)
            fmt = Formatter(
                True,
                f"chatcmpl-{uuid.uuid4().hex}",
                self.config.model_name,
                self.tok,
                req.params.logprobs is not None,
                req.return_token_ids,
            )
            return await self._generate(
                request, fmt, [ids], [params], req.stream, req.include_usage, slot, arrival
            )
        finally:
            if not slot.handed_off:
                slot.release()

    async def _off_loop(self, work: Callable[[], T]) -> T:
        """work() on the tokenizer pool; its InvalidRequestError (a bad prompt, a template's
        raise_exception, no chat template) is a 400 naming the field, on every route."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tok_pool, work)
        except InvalidRequestError as e:
            raise errors.from_invalid_request(e) from None

    @staticmethod
    def _resolve(
        ids: list[int], params: SamplingParams, param: str, max_param: str, max_len: int, vocab: int
    ) -> SamplingParams:
        """The prompt checked and max_tokens resolved against it (a 400 beyond the context, as vLLM)."""
        try:
            check_prompt(ids, params, max_len, vocab, param)
            max_tokens = resolve_max_tokens(params, len(ids), max_len, strict=True, param=max_param)
        except InvalidRequestError as e:
            raise errors.from_invalid_request(e) from None
        return dataclasses.replace(params, max_tokens=max_tokens)

    async def _generate(
        self,
        request: Request,
        fmt: Formatter,
        prompts: list[list[int]],
        params: list[SamplingParams],
        stream: bool,
        include_usage: bool,
        slot: Slot,
        arrival: float,
    ) -> Response:
        choices = [
            Choice(self.upstream, self.tok, i, ids, p, f"{fmt.id}-{i}", arrival)
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        gen = Generation(choices)
        if not stream:
            try:
                results = await until_disconnect(request, self._run(gen))
            finally:
                gen.close()
            return JSONResponse(fmt.response(results))
        try:
            await until_disconnect(request, gen.open())
        except BaseException:
            gen.close()
            raise
        slot.handed_off = True

        def cleanup() -> None:
            gen.close()
            slot.release()

        return SSEResponse(self._sse(gen, fmt, include_usage), cleanup)

    @staticmethod
    async def _run(gen: Generation) -> list:
        await gen.open()
        return await gen.results()

    async def _sse(self, gen: Generation, fmt: Formatter, include_usage: bool) -> AsyncIterator[str]:
        try:
            for c in gen.choices:
                opening = fmt.role_chunk(c.index)
                if opening is not None:
                    yield sse(opening)
            async for c, ev in self._unless_ending(gen.events()):
                if (
                    ev.text
                    or ev.tokens
                    or ev.finish_reason is not None
                    or (fmt.return_token_ids and ev.token_ids)
                ):
                    yield sse(fmt.chunk(c.index, ev.text, ev.tokens, ev.finish_reason, ev.token_ids))
            if include_usage:
                yield sse(fmt.usage_chunk([c.result for c in gen.choices]))
        except APIError as e:
            yield errors.error_event(e)
        except Exception:  # a router bug: end the stream in the error shape, loudly in the log
            log.exception("stream %s failed", fmt.id)
            yield errors.error_event(errors.internal("internal error while streaming"))
        yield SSE_DONE

    def end_streams(self) -> None:
        """Every open stream ends now with an error event and `[DONE]` (shutdown: RouterServer calls
        this just before uvicorn's graceful-shutdown deadline cancels the response tasks)."""
        self._ending.set()

    async def _unless_ending(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        """`events`, until end_streams() is called: then an APIError (503) instead of the next one."""
        ending = asyncio.ensure_future(self._ending.wait())
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

    # --- the rest of the API -------------------------------------------------
    def models(self, request: Request) -> dict:
        self.check_auth(request)
        limits = self.replicas.limits()
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pipeserve",
            "root": self.config.model,
            "parent": None,
            "max_model_len": limits[0] if limits else None,
        }
        return {"object": "list", "data": [card]}

    def health(self) -> Response:
        ready = self.replicas.ready_groups()
        if not ready:
            raise errors.unavailable("no pipeline group is ready")
        return JSONResponse({"status": "ok", "ready_groups": len(ready), "groups": len(self.replicas.groups)})

    async def health_generate(self) -> Response:
        async with self._probe_lock:  # concurrent checks share one probe: the next sees its tokens as recent
            groups = self.replicas.ready_groups()
            if not groups:
                raise errors.unavailable("no pipeline group is ready")
            now = time.monotonic()
            recent = self.config.health_generate_recent_s
            for g in groups:
                age = self.replicas.seconds_since_token(g, now)
                if 0 <= age <= recent:
                    return JSONResponse({"status": "ok", "group": g.name, "probe": False})
            idle = [g for g in groups if g.idle]
            if not idle:  # never probe a busy group; by the polled figures none has produced a token lately
                self.metrics.probes.labels("busy_silent").inc()
                raise errors.unavailable(f"every ready group is busy and none produced a token in {recent}s")
            g = idle[0]
            why = await self.upstream.probe(g.name, self.tok.encode(PROBE_TEXT) or [0])
            self.metrics.probes.labels("ok" if why is None else "failed").inc()
            if why is not None:
                log.warning("health probe of group %s failed: %s", g.name, why)
                raise errors.unavailable(f"probe of group {g.name} failed: {why}")
            return JSONResponse({"status": "ok", "group": g.name, "probe": True})
