"""Router test helpers: a scripted Generation server and a router on a free port.

`ScriptedStage` speaks the real generation.proto over real gRPC, but its
replies are scripted: it exists for the fault cases a live stage cannot be
made to show on demand (a stall before the first token, RESOURCE_EXHAUSTED,
a failure after the first token). Happy paths are also covered against live
stage processes in test_router_e2e.py.

`RouterHarness` runs, in one background thread and one event loop, the
scripted stages, the ReplicaSet and the router app under uvicorn, exactly as
`pipeserve up` runs them. Everything binds 127.0.0.1 on free ports; every
wait has a deadline; leaving the `with` block stops it all.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from pipeserve.config import RouterConfig
from pipeserve.router.http.app import build_app, uvicorn_server
from pipeserve.router.upstream.replicas import ReplicaSet
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc import generation_pb2_grpc as pb_grpc
from serving_support import wait_until

FAST = {
    "health_interval_s": 0.05,
    "rpc_timeout_s": 1.0,
    "first_token_timeout_s": 5.0,
    "stream_idle_timeout_s": 5.0,
}


class ScriptedStage(pb_grpc.GenerationServicer):
    """Stage 0 with scripted replies: every request gets `reply` (cut at max_tokens), one token a message.

    mode: "ok", or a failure: "unavailable" | "exhausted" | "invalid" | "internal" (before the
    first token), "stall_first" (never answers), "stall_after_first", "fail_after_first".
    """

    def __init__(self, reply: list[int], vocab_size: int = 1024, max_model_len: int = 2048) -> None:
        self.reply = reply
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.mode = "ok"
        self.ready = True
        self.token_delay_s = 0.0
        self.seconds_since_token = -1.0
        self.extra_running = 0  # pretend load, as if other clients' requests were running
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = 0
        self.active = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        self.active += 1
        try:
            fail = {
                "unavailable": grpc.StatusCode.UNAVAILABLE,
                "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
                "internal": grpc.StatusCode.INTERNAL,
            }
            if self.mode in fail:
                await context.abort(fail[self.mode], f"scripted {self.mode}")
            if self.mode == "invalid":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "top_k: scripted rejection")
            if self.mode == "stall_first":
                await asyncio.sleep(3600)
            tokens = self.reply[: request.sampling.max_tokens]
            for i, t in enumerate(tokens):
                if i == 1 and self.mode == "stall_after_first":
                    await asyncio.sleep(3600)
                if i == 1 and self.mode == "fail_after_first":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "group stopped: scripted")
                last = i == len(tokens) - 1
                finish = (
                    "" if not last else ("length" if len(tokens) == request.sampling.max_tokens else "stop")
                )
                msg = pb.GenerateResponse(
                    token_ids=[t], finish_reason=finish, prompt_tokens=len(request.prompt_token_ids)
                )
                if request.sampling.HasField("logprobs"):
                    top = [(t, -0.25), ((t + 1) % self.vocab_size, -1.5), ((t + 2) % self.vocab_size, -2.5)]
                    entry = msg.logprobs.add(logprob=-0.25)
                    for tid, lp in top[: request.sampling.logprobs]:
                        entry.top.add(token_id=tid, logprob=lp)
                yield msg
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=False)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(
            ready=self.ready,
            status="ready" if self.ready else "starting",
            model="scripted",
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            seconds_since_token=self.seconds_since_token,
            running=self.active + self.extra_running,
            waiting=0,
        )

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        return pb.LoadResponse(
            running=self.active + self.extra_running, waiting=0, kv_blocks_used=0, kv_blocks_total=64
        )


class RouterHarness:
    """The router (and any scripted stages) served from a background thread; a context manager."""

    def __init__(
        self,
        model_dir: Path,
        stages: dict[str, ScriptedStage | str],
        wait_ready: int | None = None,
        **config: Any,
    ) -> None:
        self.stages = stages
        self.config = RouterConfig(model=str(model_dir), **{**FAST, **config})
        self.registry = CollectorRegistry()
        self.wait_ready = len(stages) if wait_ready is None else wait_ready
        self.loop: asyncio.AbstractEventLoop | None = None
        self.replicas: ReplicaSet | None = None
        self.url = ""
        self._server = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> RouterHarness:
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets; without it every
        # keep-alive response waits out the client's delayed ACK (~40 ms).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._main, args=(sock,), name="router-harness", daemon=True)
        self._thread.start()
        wait_until(
            lambda: self._error or (self._server is not None and self._server.started), 30, "router start"
        )
        if self._error:
            raise self._error
        if self.wait_ready:
            assert self.run(self.replicas.wait_ready(self.wait_ready, 60), 70), "groups not ready"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
            assert not self._thread.is_alive(), "router harness did not stop within 30 s"

    def _main(self, sock: socket.socket) -> None:
        try:
            asyncio.run(self._serve(sock))
        except BaseException as e:  # handed to the test thread, which raises it
            self._error = e
            raise

    async def _serve(self, sock: socket.socket) -> None:
        self.loop = asyncio.get_running_loop()
        for s in self.stages.values():
            if isinstance(s, ScriptedStage):
                await s.start()
        targets = {n: s.target if isinstance(s, ScriptedStage) else s for n, s in self.stages.items()}
        self.replicas = ReplicaSet(self.config, targets, self.registry)
        await self.replicas.start()
        app = build_app(self.config, self.replicas, self.registry)
        server = uvicorn_server(app, self.config, log_level="error")
        self._server = server
        try:
            await server.serve(sockets=[sock])
        finally:
            await self.replicas.close()
            for s in self.stages.values():
                if isinstance(s, ScriptedStage):
                    await s.stop()

    def poll(self) -> None:
        """Poll every group now (the tests that set a long health_interval_s drive polls themselves)."""
        replicas = self.replicas
        assert replicas is not None

        async def poll_all() -> None:
            await asyncio.gather(*(replicas._poll(g) for g in replicas.groups.values()))

        self.run(poll_all())

    def run(self, coro: Coroutine, timeout_s: float = 30.0) -> Any:
        """Run a coroutine in the router's loop (grpc.aio objects belong to it)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Run a plain function in the router's loop (state the loop owns, e.g. set_down)."""

        async def wrapped() -> Any:
            return fn()

        return self.run(wrapped(), timeout_s)
