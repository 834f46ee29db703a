"""The router's request handling: tokenization, generation, responses, health.

The request edge (auth, body, admission slots, disconnects) is router/http/edge.py.

Order of checks on a generation request (first failure answers):
  401 bad/missing API key -> 400 malformed body or invalid field -> 404 unknown
  model -> 400/429 the prompts do not fit `max_concurrency` (edge.Admission) -> 503 no
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
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from pipeserve.config import RouterConfig
from pipeserve.errors import InvalidRequestError
from pipeserve.request_defaults import load_defaults
from pipeserve.router import errors
from pipeserve.router.api.chat_output import TOOL_CHOICES, ChatOutput, kept_tags
from pipeserve.router.api.protocol import ChatRequest, CompletionRequest, parse_chat, parse_completion
from pipeserve.router.api.responses import Formatter, chat_formatter, completion_formatter
from pipeserve.router.errors import APIError
from pipeserve.router.features import structured
from pipeserve.router.features.cost import check_cost
from pipeserve.router.features.tool_output import ToolCallOutput
from pipeserve.router.features.tools import check_parser, note_ignored_tools
from pipeserve.router.http.edge import (
    Admission,
    Slot,
    SSEResponse,
    check_auth,
    read_json,
    until_disconnect,
)
from pipeserve.router.http.sse_events import sse_events
from pipeserve.router.upstream import fanout
from pipeserve.router.upstream.metrics import RouterMetrics
from pipeserve.router.upstream.replicas import ReplicaSet
from pipeserve.router.upstream.serving import Choice, Generation
from pipeserve.router.upstream.trace import RequestAttributes
from pipeserve.router.upstream.upstream import Upstream
from pipeserve.rpc.convert import sampling_to_proto
from pipeserve.sampling_params import SamplingParams, check_prompt, resolve_max_tokens
from pipeserve.tokenizer import TokenizerAssets

log = logging.getLogger("pipeserve.router")
T = TypeVar("T")
PROBE_TEXT = "Hello"


class Router:
    def __init__(self, config: RouterConfig, replicas: ReplicaSet, registry: CollectorRegistry) -> None:
        self.config = config
        self.replicas = replicas
        self.registry = registry
        self.tok = TokenizerAssets.load(config.model, config.chat_template)
        # Sampling defaults of the model (its generation_config.json), said once at start-up.
        self.defaults = load_defaults(config.model, config.generation_config)
        if self.defaults.values:
            log.info("%s: %s", config.model_name, self.defaults.describe())
        # Tokenization and chat rendering run here, off the event loop (encode releases the GIL).
        self.tok_pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="pipeserve-tokenize")
        self.metrics = RouterMetrics(registry)
        self.upstream = Upstream(replicas, config, self.metrics)
        self.admission = Admission(config.max_concurrency, self.metrics.in_flight)
        self.created = int(time.time())
        # The text the detokenizer keeps for the parsers, per tool_choice (known before any output).
        self._kept_tags = {
            choice: kept_tags(config.reasoning_parser, config.tool_call_parser, choice)
            for choice in TOOL_CHOICES
        }
        self._probe_lock = asyncio.Lock()
        self._ending = asyncio.Event()  # shutdown: open streams end now (end_streams)

    # --- admission -----------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        check_auth(request, self.config.api_key)

    async def read_json(self, request: Request) -> Any:
        return await read_json(request, self.config.body_timeout_s)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise errors.model_not_found(model)

    def limits(self) -> tuple[int, int]:
        limits = self.replicas.limits()
        if not self.replicas.ready_groups() or limits is None:
            raise errors.unavailable("no pipeline group is ready")
        return limits

    # --- generation ----------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        """The way, in this order (docs/architecture.md): parse, validate, plan and open (pick a group,
        stream), format."""
        arrival = time.monotonic()
        self.check_auth(request)
        req = parse_completion(await self.read_json(request), self.defaults)
        self.check_model(req.model)
        param = "best_of" if req.best_of > 1 else "prompt"
        slot = self._acquire(len(req.prompts) * req.best_of, param)
        try:
            max_len, vocab = self.limits()
            ids = await self._off_loop(lambda: self._prompt_ids(req, max_len))
            params = [
                self._resolve(
                    x, req.params, "prompt", req.max_tokens_param, max_len, vocab, req.max_tokens_from_model
                )
                for x in ids
            ]
            scoring = "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"  # echo's
            self._check_cost(ids, params, req.n, req.best_of, req.max_tokens_param, scoring)
            echoed = None
            if req.echo:
                echoed = [
                    p if isinstance(p, str) else self.tok.decode(x)
                    for p, x in zip(req.prompts, ids, strict=True)
                ]
            rid = f"cmpl-{uuid.uuid4().hex}"
            families = fanout.plan(ids, params, req.n, req.best_of, rid, echoed, req.max_tokens_zero)
            try:
                return await self._generate(
                    request,
                    lambda: completion_formatter(req, rid, self.config.model_name, self.tok),
                    None,  # no parser: the tokenizer's own decode
                    families,
                    params,
                    req.stream,
                    req.include_usage,
                    slot,
                    arrival,
                    req.n,
                )
            except APIError as e:  # a schema stage 0 could not compile names the client's field
                raise structured.rename(e, req.structured) from None
        finally:
            if not slot.handed_off:
                slot.release()

    def _prompt_ids(self, req: CompletionRequest, max_len: int) -> list[list[int]]:
        """Each prompt's token ids: text encoded (its length checked), ids as given."""
        return [
            self.tok.encode_prompt(p, req.add_special_tokens, max_len, "prompt") if isinstance(p, str) else p
            for p in req.prompts
        ]

    def _parsed(self, req: ChatRequest) -> bool:
        """A chat choice's text goes through parsers: tool calls (unless tool_choice is "none") or
        reasoning."""
        return req.tools.choice != "none" or self.config.reasoning_parser is not None

    def _output(self, req: ChatRequest) -> ChatOutput | None:
        """The parsers' view of a chat choice's text (router/api/chat_output.py), made with the
        Formatter: reasoning, content and tool calls."""
        if not self._parsed(req):
            return None
        c = self.config
        tools = ToolCallOutput(req.tools, c.tool_call_parser) if req.tools.choice != "none" else None
        return ChatOutput(tools, c.reasoning_parser, req.chat_args.template_kwargs)

    def _chat_ids(self, req: ChatRequest, max_len: int) -> list[int]:
        """The messages rendered by the chat template and encoded (their length checked)."""
        a = req.chat_args
        text = self.tok.render_chat(
            req.messages,
            req.tools.tools,
            a.add_generation_prompt,
            a.continue_final_message,
            a.template_kwargs,
        )
        return self.tok.encode_prompt(text, req.add_special_tokens, max_len, "messages")

    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_auth(request)
        req = parse_chat(await self.read_json(request), self.defaults)
        self.check_model(req.model)
        check_parser(req.tools, self.config.tool_call_parser)
        slot = self._acquire(req.n, "n")
        try:
            max_len, vocab = self.limits()
            ids = await self._off_loop(lambda: self._chat_ids(req, max_len))
            note_ignored_tools(request, req.tools, self.tok.chat_template)  # a Warning header
            params = self._resolve(
                ids, req.params, "messages", req.max_tokens_param, max_len, vocab, req.max_tokens_from_model
            )
            self._check_cost([ids], [params], req.n, req.n, req.max_tokens_param, "prompt_logprobs")
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            families = fanout.plan([ids], [params], req.n, req.n, rid)
            try:
                return await self._generate(
                    request,
                    lambda: chat_formatter(req, rid, self.config.model_name, self.tok, self._output(req)),
                    self._kept_tags[req.tools.choice] if self._parsed(req) else None,
                    families,
                    [params],
                    req.stream,
                    req.include_usage,
                    slot,
                    arrival,
                    req.n,
                )
            except APIError as e:  # a schema stage 0 could not compile names the client's field
                raise structured.rename(e, req.structured) from None
        finally:
            if not slot.handed_off:
                slot.release()

    def _acquire(self, units: int, param: str) -> Slot:
        """Admission for `units` upstream calls. A fan-out (units > 1) may not take the last
        quarter of max_concurrency while anything else is in flight: those slots stay for
        single-generation requests, so a few n=128 requests cannot turn everyone else away with
        429 (issue 29). Alone, it may take them all (or it could never be served)."""
        a = self.admission
        reserve = a.limit // 4
        if units > 1 and a.in_flight and a.in_flight + units > a.limit - reserve:
            raise errors.too_many_requests(
                f"the router has {a.in_flight} generations in flight and this request adds {units}; "
                f"the last {reserve} of max_concurrency {a.limit} are kept for requests of one generation"
            )
        return a.acquire(units, param)

    def _check_cost(
        self, ids: list[list[int]], params: list[SamplingParams], n: int, best_of: int, mt: str, scoring: str
    ) -> None:
        """A 400 when the request costs more than one request may cost here (router/features/cost.py)."""
        c = self.config
        check_cost(ids, params, n, best_of, mt, scoring, c.max_prompt_scoring, c.max_generated_tokens)

    async def _off_loop(self, work: Callable[[], T]) -> T:
        """work() on the tokenizer pool; its InvalidRequestError (a bad prompt, a template's
        raise_exception, no chat template) is a 400 naming the field, on every route."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tok_pool, work)
        except InvalidRequestError as e:
            raise errors.from_invalid_request(e) from None

    @staticmethod
    def _resolve(
        ids: list[int],
        params: SamplingParams,
        param: str,
        max_param: str,
        max_len: int,
        vocab: int,
        model_max: bool = False,
    ) -> SamplingParams:
        """The prompt checked and max_tokens resolved against it (a 400 beyond the context, as vLLM);
        `model_max`: max_tokens is the model's default, cut to what the context leaves instead."""
        try:
            check_prompt(ids, params, max_len, vocab, param)
            max_tokens = resolve_max_tokens(params, len(ids), max_len, strict=not model_max, param=max_param)
            if model_max:
                max_tokens = min(max_tokens, max(1, max_len - len(ids)))
        except InvalidRequestError as e:
            raise errors.from_invalid_request(e) from None
        return dataclasses.replace(params, max_tokens=max_tokens)

    async def _generate(
        self,
        request: Request,
        formatter: Callable[[], Formatter],
        tags: tuple[str, ...] | None,
        families: list[list[fanout.Planned]],
        params: list[SamplingParams],
        stream: bool,
        include_usage: bool,
        slot: Slot,
        arrival: float,
        n: int = 1,
    ) -> Response:
        """Every planned call opened (a group picked, the first message read), then the stream, then
        the response: the Formatter is made only once the streams are open."""
        # The parsers' tags survive detokenization even where the tokenizer marks them special.
        decode = self.tok.decoder(tags) if tags is not None else self.tok.decode
        opened: list[Choice] = []
        attributes = RequestAttributes(self.config.model_name, params)
        try:
            choices = await until_disconnect(request, self._open(families, decode, arrival, opened))
        except BaseException:  # one choice failed (or the client left): none of them goes on
            for c in opened:
                c.close()
            groups = [c.group for c in opened if c.group is not None]
            attributes.ended([c.result for c in opened], groups, sum(c.retries for c in opened))
            raise
        gen = Generation(choices, attributes, n)
        if not stream:
            try:
                results = await until_disconnect(request, gen.results())
            finally:
                gen.close()
            return JSONResponse(formatter().response(results))
        slot.handed_off = True

        def cleanup() -> None:
            gen.close()
            slot.release()

        return SSEResponse(sse_events(gen, formatter(), include_usage, self._ending), cleanup)

    async def _open(
        self,
        families: list[list[fanout.Planned]],
        decode: Callable[[list[int]], str],
        arrival: float,
        opened: list[Choice],
    ) -> list[list[Choice]]:
        """Each family opened, leader first (router/upstream/fanout.py); `opened` collects the
        choices as they open, for the caller to close if another fails."""

        async def open_one(planned: fanout.Planned, prefer: str | None) -> Choice:
            sampling = sampling_to_proto(planned.params)  # max_tokens already resolved against the prompt
            stream, first = await self.upstream.open(planned.prompt_ids, sampling, planned.request_id, prefer)
            choice = Choice(self.upstream.calls, decode, planned, stream, first, arrival)
            opened.append(choice)
            return choice

        return await fanout.open_all([fanout.open_family(f, open_one) for f in families])

    def end_streams(self) -> None:
        """Every open stream ends now with an error event and `[DONE]` (shutdown: RouterServer calls
        this just before uvicorn's graceful-shutdown deadline cancels the response tasks)."""
        self._ending.set()

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
                # Monitors call this every few seconds: one line per group per interval, not per call.
                self.upstream.rlog.warning(
                    ("probe", g.name), "health probe of group %s failed: %s", g.name, why
                )
                raise errors.unavailable(f"probe of group {g.name} failed: {why}")
            return JSONResponse({"status": "ok", "group": g.name, "probe": True})
