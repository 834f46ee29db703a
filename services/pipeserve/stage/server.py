"""Stage 0's request server: the Generation gRPC service in front of the EngineLoop.

Lifecycle of `serve_leader` (the process of stage 0):
  loading/joining  the engine is built (model, pool, ring formed and warmed)
  ready            the engine loop and the gRPC server run; /readyz is 200
  draining         SIGTERM/SIGINT: new Generate calls get UNAVAILABLE, running
                   requests finish (at most drain_timeout_s), then the ring is
                   shut down cleanly (every follower exits 0) and so do we
  stopped          the group stopped (a stage died, hung or diverged): every
                   open call ends with UNAVAILABLE naming the cause, the
                   process exits EXIT_GROUP_STOP and the supervisor restarts
                   the whole group

A Generate call that is cancelled (the router's client went away, a stop
string matched, a deadline passed) aborts its request: its blocks return to
the pool on every stage with the next plan.

Status codes say whose failure it is, because the router acts on them:
  INVALID_ARGUMENT   the request is invalid ("param: message")
  ALREADY_EXISTS     its request id is already running here
  RESOURCE_EXHAUSTED the admission queue is full (try another group)
  INTERNAL           the request itself failed on some stage ("request failed:
                     ..."): the group goes on serving; never retried
  UNAVAILABLE        the group is not serving (starting, draining) or stopped
                     (the cause): the only code that takes a group out of routing
Once a request is admitted, its call carries the initial metadata
ADMITTED_KEY, and so does the status of a call that then fails: a call that
fails with UNAVAILABLE saw its group die with the request inside, and the
router must not carry it to another group. (The status carries it too because
a router once read a poisoned call's UNAVAILABLE without the initial metadata
under make test-stress, and carried the poison to a second group.)

`/readyz` and Health read one function (StageStatus.ready), so they agree at
all times: a group stop makes both say not ready at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc

from pipeserve.care.health import Metric, StageStatus
from pipeserve.care.wedge import WedgeDetector
from pipeserve.config import EngineConfig, StageServeConfig
from pipeserve.engine.grammar_pool import CompileBusy, GrammarPool
from pipeserve.errors import ExitCode, InvalidRequestError
from pipeserve.lifecycle import ProcessPhase
from pipeserve.obs import tracing
from pipeserve.obs.flight import DumpOnSignal
from pipeserve.ring.group import Rendezvous
from pipeserve.ring.leader import PipelineExecutor
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc import generation_pb2_grpc as pb_grpc
from pipeserve.rpc.convert import sampling_from_proto
from pipeserve.rpc.metadata import ADMITTED_KEY
from pipeserve.sampling_params import SamplingParams
from pipeserve.stage.assemble import build_leader
from pipeserve.stage.cache_metrics import leader_tier_metrics, stage_tier_metrics
from pipeserve.stage.engine_loop import (
    Delta,
    DuplicateRequest,
    EngineLoop,
    ErrorKind,
    NotServing,
    Overloaded,
    engine_thread,
)
from pipeserve.stage.engine_metrics import busy_metrics, engine_metrics
from pipeserve.stage.request_trace import RequestTrace, generate_interceptor

log = logging.getLogger(__name__)

_ERROR_CODES = {
    ErrorKind.GROUP: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.FAILED: grpc.StatusCode.INTERNAL,
}


def delta_to_proto(d: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        token_ids=d.token_ids,
        finish_reason=d.finish_reason or "",
        prompt_tokens=d.prompt_tokens,
        cached_tokens=d.cached_tokens,
    )
    for lp, top in d.logprobs or ():
        entry = msg.logprobs.add(logprob=lp if lp is not None else 0.0)
        for tok, v in top or ():
            entry.top.add(token_id=tok, logprob=v)
    for lp, rank, top in d.prompt_logprobs or ():
        p = msg.prompt_logprobs.add(logprob=lp, rank=rank)
        for tok, v in top:
            p.top.add(token_id=tok, logprob=v)
    return msg


class _QueueSink:
    """Hands the loop thread's deltas to one call's asyncio queue."""

    def __init__(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.aloop = aloop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()

    def push(self, delta: Delta) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, delta)
        except RuntimeError:
            pass  # the server's event loop has closed: the call is gone with it


CALLS_END_S = 10.0  # how long a stopping server waits for its open calls to send their status


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self, loop: EngineLoop, model_name: str, status: StageStatus, pool: GrammarPool | None = None
    ) -> None:
        self.loop = loop
        self.pool = pool
        self.model_name = model_name
        self.status = status
        engine = loop.engine
        self.open_calls = 0  # admitted Generate calls that have not returned their status yet
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        sink = _QueueSink(asyncio.get_running_loop())
        try:
            params = sampling_from_proto(request.sampling)
            await self._compile_grammar(params)
            self.loop.submit(rid, list(request.prompt_token_ids), params, sink, RequestTrace.start(rid))
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.param}: {e.message}")
        except DuplicateRequest as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {e}")
        except (Overloaded, CompileBusy) as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NotServing as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"group not serving: {e}")
        final = False
        self.open_calls += 1  # admitted: counted until its status is sent (_serve waits for them)
        try:
            await context.send_initial_metadata(((ADMITTED_KEY, "1"),))
            while not final:
                delta = await sink.queue.get()
                final = delta.final
                if delta.error is not None:
                    code = _ERROR_CODES[delta.error_kind]
                    prefix = "request failed: " if delta.error_kind is ErrorKind.FAILED else ""
                    await context.abort(code, prefix + delta.error, ((ADMITTED_KEY, "1"),))
                yield delta_to_proto(delta)
        finally:
            self.open_calls -= 1
            if not final:  # cancelled: the client went away or its deadline passed
                self.loop.abort(rid)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Stage 0 decides: a structured spec compiles (in the killable pool, engine/grammar_pool.py:
        a queue deadline, then a compile budget) before the request is admitted; submit's own check
        then finds it in the book (engine/grammar.py). A call cancelled meanwhile kills its compile."""
        book = self.loop.engine.grammar_book
        if not params.structured_kind or book is None:
            return
        args = (params.structured_kind, params.structured, params.structured_compact)
        if self.pool is None:  # no tokenizer for the pool: the book says why, at once
            await asyncio.to_thread(book.compile, *args)
            return
        await self.pool.compile(*args)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.loop.abort(request.request_id))

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        s = self.loop.stats
        return pb.HealthResponse(
            ready=self.status.ready,
            status=self.loop.status,
            model=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            seconds_since_token=-1.0 if s.last_token_at is None else time.monotonic() - s.last_token_at,
            running=s.running,
            waiting=s.waiting,
        )

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        s = self.loop.stats
        return pb.LoadResponse(
            running=s.running,
            waiting=s.waiting,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            pending_tokens=s.pending_tokens,
        )


async def _grammar_pool(loop: EngineLoop, status: StageStatus) -> GrammarPool | None:
    """The structured-output compilers: the tokenizer's grammar info built before the stage says
    ready (the first structured request does not pay for it), the workers starting meanwhile."""
    book = loop.engine.grammar_book
    if book is None:
        return None
    pool = GrammarPool(book)
    try:
        await pool.start()
    except Exception as e:  # noqa: BLE001 - no tokenizer xgrammar can read: structured requests say so
        log.warning("structured outputs unavailable: %s: %s", type(e).__name__, e)
        await pool.close()
        return None
    log.info("grammar info built; %d compiler workers starting", pool.workers)
    status.sources.append(lambda: grammar_metrics(pool))
    return pool


def grammar_metrics(pool: GrammarPool) -> dict[str, Metric]:
    p = "pipeserve:"
    return {
        p + "grammar_compiles_waiting": Metric(
            "gauge", "structured specs waiting for a compiler", pool.queued
        ),
        p + "grammar_compiles_running": Metric("gauge", "structured specs compiling now", pool.running),
        p + "grammar_workers": Metric("gauge", "grammar compiler processes started and ready", pool.warm()),
        p + "grammar_workers_killed": Metric(
            "counter", "compiler processes killed (past the budget, cancelled, failed)", pool.killed
        ),
    }


async def _serve(loop: EngineLoop, serve: StageServeConfig, status: StageStatus, model_name: str) -> int:
    # Tracing on: the official interceptor makes Generate's server span from the router's traceparent.
    interceptors = [generate_interceptor()] if tracing.enabled() else []
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
    # Before anything that takes seconds (the tokenizer's grammar info): a SIGTERM meanwhile is a
    # clean shutdown round the ring, not the default action's death of stage 0 alone.
    aloop = asyncio.get_running_loop()
    term = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, term.set)
    pool = await _grammar_pool(loop, status)
    service = GenerationService(loop, model_name, status, pool)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    port = server.add_insecure_port(f"{serve.host}:{serve.grpc_port}")
    await server.start()
    status.phase = ProcessPhase.READY
    log.info("stage 0 serving gRPC on %s:%d (model %s)", serve.host, port, model_name)
    while not term.is_set() and not loop.done.is_set():  # serving: until a signal or a group stop
        await asyncio.sleep(0.1)
    if term.is_set() and not loop.done.is_set():
        status.phase = ProcessPhase.DRAINING
        log.info("draining: %d running, %d waiting", loop.stats.running, loop.stats.waiting)
        loop.drain()
        if not await asyncio.to_thread(loop.join, serve.drain_timeout_s):
            log.warning("drain timed out after %.0fs: ending the remaining requests", serve.drain_timeout_s)
            loop.end("server shutting down")
    await asyncio.to_thread(loop.join, loop.engine.config.ring_timeout_s + 5)
    # Every open call has its final delta by now; let each send it (its status, and the ADMITTED
    # metadata the router reads to never carry a request that killed this group to another) before
    # the server stops: on a loaded machine one second of grace can pass before a call runs again.
    deadline = time.monotonic() + CALLS_END_S
    while service.open_calls and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await server.stop(grace=1.0)
    if pool is not None:
        await pool.close()
    status.phase = ProcessPhase.STOPPED
    if loop.failed:
        return ExitCode.DIVERGED if loop.diverged else ExitCode.GROUP_STOP
    if not loop.done.is_set():
        log.error("engine loop did not end within its deadline; leaving the ring to its deadlines")
        return ExitCode.GROUP_STOP
    return ExitCode.OK


def serve_leader(config: EngineConfig, serve: StageServeConfig, rdzv: Rendezvous, status: StageStatus) -> int:
    """Build the engine (the group forms), serve until SIGTERM or a group stop; the exit status."""
    status.phase = ProcessPhase.JOINING
    thread = engine_thread()
    # Waiting on the build is calling it: its deadlines (rendezvous, ring) are build_leader's own.
    leader = thread.submit(build_leader, config, rdzv).result()
    engine, tiers = leader.engine, leader.tiers
    loop = EngineLoop(engine, serve.max_waiting, thread)
    detector = WedgeDetector("stage 0", loop.pending_work, serve.wedge_timeout_s, serve.wedge_grace_s)
    status.detector = detector
    status.serving = lambda: (
        loop.phase is ProcessPhase.READY
    )  # a group stop is not-ready at once, here and in Health
    status.sources.append(lambda: engine_metrics(loop))
    status.sources.append(lambda: busy_metrics(engine.executor.meter))
    status.sources.append(lambda: leader_tier_metrics(engine))
    status.sources.append(lambda: stage_tier_metrics(tiers))
    loop.on_progress = detector.beat
    if isinstance(ring := engine.executor, PipelineExecutor):  # one stage: no ring, nothing recorded
        detector.on_wedge = lambda: ring.flight.dump(f"wedge: {detector.report}")
        DumpOnSignal(ring.flight).install()
    loop.start()
    detector.start()
    code = asyncio.run(_serve(loop, serve, status, serve.served_model_name or config.model))
    detector.stop()
    if code == 0:
        engine.shutdown()  # the clean Stop round: every follower exits 0
    return code
