"""`pipeserve up`: R pipeline groups of S stage processes, the router, and their supervisor.

One process runs the router (FastAPI on uvicorn, on the main thread's loop)
and the supervisor (on its own thread and loop, so a client that stalls the
router cannot stall it; its calls into the router go through
`call_soon_threadsafe`); every stage is a child process (`pipeserve stage`) that exits
on its own if this process dies (PIPESERVE_PARENT_PID), so no stage outlives
it. Start-up prints one line, `pipeserve: serving <model> at http://H:P/v1`,
once the router listens and every group is ready. Before anything starts (a stage, Redis, the
router), `--model` is resolved and checked (model_path.py: a .gguf file converted once into
the cache, the loader's own config parse in a child interpreter, the request defaults read), so a
model that cannot be served is one line and ExitCode.CANNOT_START within seconds.

SIGTERM / SIGINT drain: the router stops accepting connections and lets
in-flight responses finish (drain_timeout_s), every stage 0 drains its
requests and shuts its ring down cleanly, and stragglers are killed after a
bounded wait. Streams the drain deadline would cut end with an error event
and `data: [DONE]` just before it (RouterServer). A second signal skips the
drain. `/groups` (pids, ports) requires the API key when one is set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import shutil
import signal
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pipeserve.config import (
    EngineConfig,
    RouterConfig,
    StageServeConfig,
    SupervisorConfig,
    add_config_args,
    config_from_args,
)
from pipeserve.config.fields import flag_help
from pipeserve.config.flags import group
from pipeserve.errors import ConfigError, ExitCode
from pipeserve.router.http.http_guard import RouterServer, server_config

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pipeserve.local.ports import PortBook
    from pipeserve.local.redis_server import LocalRedis
    from pipeserve.router.upstream.replicas import ReplicaSet
    from pipeserve.supervisor.group import GroupSlot
    from pipeserve.supervisor.supervisor import Supervisor

# The parser (`add_up_parser`, built by `pipeserve --help` and every subcommand, the operator's
# images included) must not import torch: what reaches the ring (local.launcher, local.redis_server,
# supervisor.group -> ring.group -> torch) is imported inside the functions that run `up`.
# Start-up order: the stages are launched first (their torch import and weight load are the long
# pole), the private Redis and the router's imports (FastAPI) happen while they start.

log = logging.getLogger("pipeserve.up")


class _Server(RouterServer):
    """uvicorn without its own signal handling: `pipeserve up` decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


# What `pipeserve up` fixes itself rather than take as a flag: stages are its children, so their
# ports are free ones on 127.0.0.1; the checkpoint and the served name are shared with the router.
_UP_SERVE_FIXED = {"host", "health_port", "grpc_port", "served_model_name"}
_UP_ROUTER_FIXED = {"model"}
REPLICAS = 1  # --replicas's default: `up`'s own flag, no config field
SUPERVISOR_PREFIX = "supervisor_"  # --supervisor-backoff-s ...: the router has a probe_timeout_s too


def add_up_parser(sub: argparse._SubParsersAction) -> None:
    """`pipeserve up`'s flags: a few of its own, then one per field of every config it builds."""
    u = sub.add_parser("up", help="serve: R pipeline groups of S stages behind the OpenAI-compatible router")
    add_config_args(u, EngineConfig, skip=set())  # --model, --stages and --log-dir included
    group(u, "serving").add_argument(
        "--replicas",
        type=int,
        default=REPLICAS,
        metavar="N",
        help=flag_help("pipeline groups", str(REPLICAS)),
    )
    add_config_args(u, RouterConfig, skip=_UP_ROUTER_FIXED)
    add_config_args(u, StageServeConfig, skip=_UP_SERVE_FIXED)
    add_config_args(u, SupervisorConfig, skip=set(), prefix=SUPERVISOR_PREFIX)
    u.set_defaults(func=run_up, quantization=None)  # None: model_path.default_quantization


@dataclasses.dataclass(frozen=True)
class UpConfigs:
    engine: EngineConfig
    serve: StageServeConfig
    router: RouterConfig
    supervisor: SupervisorConfig
    replicas: int


def build_configs(args: argparse.Namespace) -> UpConfigs:
    """Every config `up` runs with, and every check of them and of the model that can fail before
    anything starts (`check_model`: reads the model; tests build configs without it)."""
    from pipeserve.local.launcher import local_group_config
    from pipeserve.model.default import DEFAULT_MODEL_NAME
    from pipeserve.model_path import check_files, default_quantization, resolve_model

    if args.replicas < 1:
        raise ConfigError(f"replicas: must be >= 1 (got {args.replicas})")
    resolved = resolve_model(args.model)
    check_files(resolved.dir, tokenizer=True)  # the stages need the checkpoint, the router its tokenizer
    model = str(resolved.dir)
    args.quantization = default_quantization(resolved, args.quantization)
    if resolved.gguf is not None:
        log.info("%s: served from %s with --quantization %s", resolved.gguf, model, args.quantization)
    name = args.served_model_name or (args.model or DEFAULT_MODEL_NAME)
    engine = config_from_args(EngineConfig, args, model=model, stages=args.stages)
    engine = dataclasses.replace(engine, log_dir=args.log_dir)
    if engine.hicache_url is None:  # one machine: a private Redis for L3 when one can be started
        local = shutil.which("redis-server") is not None
        if not local:
            log.info("L3 off: redis-server is not installed (--hicache-url URL|local|off)")
        engine = dataclasses.replace(engine, hicache_url="local" if local else "off")
    # The machine is shared by every stage of every group.
    engine = local_group_config(engine, processes=args.stages * args.replicas)
    serve = config_from_args(
        StageServeConfig, args, skip=_UP_SERVE_FIXED, host="127.0.0.1", served_model_name=name
    )
    router = config_from_args(
        RouterConfig, args, skip=_UP_ROUTER_FIXED | {"served_model_name"}, model=model, served_model_name=name
    )
    supervisor = config_from_args(SupervisorConfig, args, skip=set(), prefix=SUPERVISOR_PREFIX)
    return UpConfigs(engine, serve, router, supervisor, args.replicas)


def bind_router_port(router: RouterConfig) -> socket.socket:
    """The router's listening address, bound before anything starts: a port already in use (another
    server, a second `make run`) is refused before Redis and the stages are, so none is left behind.
    uvicorn serves on this socket."""
    family = socket.AF_INET6 if ":" in router.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
    try:
        sock.bind((router.host, router.port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"port: cannot listen on {router.host}:{router.port} ({e.strerror}); is another server "
            f"running there? Choose another with --port"
        ) from None
    return sock


async def serve_up(configs: UpConfigs, sock: socket.socket) -> int:
    engine = configs.engine

    from pipeserve.local.ports import PortBook
    from pipeserve.local.redis_server import LocalRedis

    registry = CollectorRegistry()
    ports = PortBook()  # every port this `up` hands out is a different one
    redis = redis_start = None
    if engine.hicache_url == "local":  # L3 on a private redis-server, kept running below
        # its port is chosen now: the stages are launched with its URL
        redis = LocalRedis(maxmemory_mb=engine.hicache_local_maxmemory_mb or None, ports=ports)
        engine = dataclasses.replace(engine, hicache_url=redis.url)
        # Started beside the stages, which reach L3 only after importing torch and loading weights.
        redis_start = asyncio.create_task(asyncio.to_thread(redis.start))
    try:
        return await _serve_groups(configs, engine, registry, redis, redis_start, sock, ports)
    finally:
        if redis_start is not None:
            await asyncio.wait([redis_start], timeout=15.0)  # start() has its own 10 s deadline
        if redis is not None:
            redis.stop()


async def _watch_redis(redis: LocalRedis) -> None:
    """Supervise the private Redis: start it again on its port if it exits (L3 only misses meanwhile)."""
    while True:
        await asyncio.sleep(1.0)
        try:
            if await asyncio.to_thread(redis.ensure_running):
                log.warning("L3: private redis-server had exited; started again at %s", redis.url)
        except (RuntimeError, OSError) as e:
            log.error("L3: cannot restart the private redis-server: %s", e)


async def _serve_groups(
    configs: UpConfigs,
    engine: EngineConfig,
    registry: CollectorRegistry,
    redis: LocalRedis | None,
    redis_start: asyncio.Task[LocalRedis] | None,
    sock: socket.socket,
    ports: PortBook,
) -> int:
    serve, router = configs.serve, configs.router
    from pipeserve.supervisor.group import GroupSlot
    from pipeserve.supervisor.supervisor import Supervisor, SupervisorThread

    slots = [GroupSlot(f"group-{g}", engine, serve, ports=ports) for g in range(configs.replicas)]
    loop = asyncio.get_running_loop()
    replica_set = None  # built once the stages are launching

    def on_down(name: str, reason: str) -> None:  # called on the supervisor's thread
        if replica_set is not None:  # before the router exists its first poll sees the group down
            loop.call_soon_threadsafe(replica_set.set_down, name, reason)

    supervisor = Supervisor(slots, registry, on_down=on_down, config=configs.supervisor)
    watcher = SupervisorThread(supervisor)
    await asyncio.to_thread(watcher.start)  # the stages start now
    if redis_start is not None:
        try:
            await redis_start
        except BaseException:
            await asyncio.to_thread(watcher.stop, 0.0, supervisor.config.kill_grace_s + 30.0)
            raise
        log.info("L3: private redis-server at %s", engine.hicache_url)

    from pipeserve.router.http.app import build_app
    from pipeserve.router.upstream.replicas import ReplicaSet

    replica_set = ReplicaSet(router, {s.name: s.grpc_target for s in slots}, registry)
    app = build_app(router, replica_set, registry)
    _add_groups_route(app, slots, replica_set)
    server = _Server(
        server_config(app, router, access_log=False, timeout_graceful_shutdown=serve.drain_timeout_s)
    )
    signals = _Signals(server)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals, sig)

    await replica_set.start()
    http = asyncio.create_task(server.serve(sockets=[sock]))
    ready = asyncio.create_task(_announce(supervisor, server, replica_set, len(slots), router))
    fatal = asyncio.create_task(_give_up(supervisor, server))
    keeper = asyncio.create_task(_watch_redis(redis)) if redis is not None else None
    await http  # returns after a signal, once in-flight HTTP responses are done (or the drain expired)
    ready.cancel()
    fatal.cancel()
    if keeper is not None:
        keeper.cancel()
    await replica_set.close()
    drain = 0.0 if signals.count > 1 or supervisor.fatal else serve.drain_timeout_s
    # Bounded: the drain, then each slot's kill grace (stages run in parallel), then a margin.
    await asyncio.to_thread(watcher.stop, drain, drain + supervisor.config.kill_grace_s + 30.0)
    return ExitCode.CANNOT_START if supervisor.fatal else ExitCode.OK


def _add_groups_route(app: FastAPI, slots: list[GroupSlot], replica_set: ReplicaSet) -> None:
    """GET /groups: the supervisor's view of every group (state, restarts, pids, endpoints) with
    the router's."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    def groups(request: Request) -> JSONResponse:
        app.state.router.check_auth(request)
        routed = {r["name"]: r for r in replica_set.snapshot()}
        return JSONResponse([{**s.snapshot(), "router": routed.get(s.name)} for s in slots])

    # A plain route (the handler gets the request): FastAPI would resolve the annotations above
    # from the module's globals, where this function-local import is not.
    app.add_route("/groups", groups, methods=["GET"], include_in_schema=False)


class _Signals:
    """SIGTERM / SIGINT: the first drains (uvicorn's graceful shutdown), a second stops at once."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.count = 0

    def __call__(self, sig: signal.Signals) -> None:
        self.count += 1
        self.server.should_exit = True
        if self.count > 1:
            self.server.force_exit = True
            log.info("%s again: stopping now, without draining", sig.name)
        else:
            log.info("%s: shutting down (draining; a second signal stops at once)", sig.name)


async def _announce(
    supervisor: Supervisor, server: _Server, replica_set: ReplicaSet, groups: int, router: RouterConfig
) -> None:
    """Say where `up` serves once every group is ready and routable."""
    while not supervisor.all_ready.is_set():  # set on the supervisor's thread
        await asyncio.sleep(0.1)
    # Ready means routable: the router's own Health polls must see every group ready too.
    while not server.started or not await replica_set.wait_ready(groups, timeout_s=1.0):
        await asyncio.sleep(0.05)
    print(f"pipeserve: serving {router.model_name} at http://{router.host}:{router.port}/v1", flush=True)


async def _give_up(supervisor: Supervisor, server: _Server) -> None:
    """The supervisor found a group that cannot start: the HTTP server stops, `up` exits."""
    while not supervisor.failed.is_set():
        await asyncio.sleep(0.1)
    log.error("cannot serve: %s", supervisor.fatal)
    server.should_exit = True


def check_model(configs: UpConfigs) -> None:
    """What only reading the model tells, before anything starts: the loader's config parse, the layer
    split and max_model_len (in a child: `up` never imports torch), the request defaults' file."""
    from pipeserve.model_path import check_config_in_child
    from pipeserve.request_defaults import load_defaults

    load_defaults(configs.router.model, configs.router.generation_config)
    check_config_in_child(configs.engine)


def run_up(args: argparse.Namespace) -> int:
    from pipeserve.obs.tracing import setup_tracing  # the stages inherit OTEL_* and PIPESERVE_TRACE_FILE

    configs = build_configs(args)
    sock = bind_router_port(configs.router)
    try:
        check_model(configs)
        traces = setup_tracing("pipeserve-router")
        try:
            return asyncio.run(serve_up(configs, sock))
        finally:
            traces.shutdown(deadline_s=3.0)
    finally:
        sock.close()
