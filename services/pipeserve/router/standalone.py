"""`pipeserve router`: the router as its own process (what a router Deployment runs).

    pipeserve router --upstream HOST:PORT[,HOST:PORT...] --model DIR [RouterConfig flags]

`--model` (or `--tokenizer`) is a directory with the tokenizer files only —
tokenizer.json, tokenizer_config.json, the chat template; the router never
loads weights. Each upstream is one group's stage 0 (its gRPC port), polled
like the groups of `pipeserve up` (the same ReplicaSet and app): a group that
is not ready, or not answering, leaves routing until its polls say ready again.
Discovery is static here; Kubernetes discovery comes with the operator.
SIGTERM/SIGINT: uvicorn's graceful shutdown, streams ended just before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator

from prometheus_client import CollectorRegistry

from pipeserve.config import RouterConfig, add_config_args, config_from_args
from pipeserve.errors import ConfigError, ExitCode

_FIXED = {"model"}


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("router", help="the OpenAI-compatible router alone, in front of running groups")
    r.add_argument(
        "--model",
        "--tokenizer",
        dest="model",
        default=os.environ.get("PIPESERVE_MODEL"),
        help="directory with the tokenizer files (no weights needed)",
    )
    r.add_argument(
        "--upstream",
        default=os.environ.get("PIPESERVE_UPSTREAM"),
        help="every group's stage 0 gRPC address, comma-separated: host:port[,host:port...]",
    )
    r.add_argument("--drain-timeout-s", type=float, default=30.0, help="SIGTERM: let responses finish")
    add_config_args(r, RouterConfig, skip=_FIXED)
    r.set_defaults(func=run_router)


def upstream_targets(text: str | None) -> dict[str, str]:
    """'h:p,h:p' -> {"group-0": "h:p", ...}, each checked."""
    if not text:
        raise ConfigError("upstream: need at least one host:port (--upstream or PIPESERVE_UPSTREAM)")
    targets = {}
    for i, part in enumerate(p.strip() for p in text.split(",")):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"upstream: expected host:port (got {part!r})")
        targets[f"group-{i}"] = part
    return targets


async def serve_router(config: RouterConfig, targets: dict[str, str], drain_timeout_s: float) -> int:
    from pipeserve.router.app import build_app
    from pipeserve.router.http_guard import RouterServer, server_config
    from pipeserve.router.replicas import ReplicaSet

    class Server(RouterServer):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the loop's handlers below decide: a second signal skips the drain

    registry = CollectorRegistry()
    replicas = ReplicaSet(config, targets, registry)
    app = build_app(config, replicas, registry)
    server = Server(server_config(app, config, timeout_graceful_shutdown=drain_timeout_s))

    def on_signal() -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await replicas.start()
    try:
        await server.serve()
    finally:
        await replicas.close()
    return ExitCode.OK


def run_router(args: argparse.Namespace) -> int:
    if not args.model:
        raise ConfigError("model: the tokenizer directory is required (--model or --tokenizer)")
    if args.drain_timeout_s < 0:
        raise ConfigError(f"drain_timeout_s: must be >= 0 (got {args.drain_timeout_s})")
    config = config_from_args(RouterConfig, args, skip=_FIXED, model=args.model)
    return asyncio.run(serve_router(config, upstream_targets(args.upstream), args.drain_timeout_s))
