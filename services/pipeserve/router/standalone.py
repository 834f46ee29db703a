"""`pipeserve router`: the router as its own process (what a router Deployment runs).

    pipeserve router --upstream HOST:PORT[,HOST:PORT...] --model DIR [RouterConfig flags]
    pipeserve router --discover kubernetes [--namespace NS] --pipeline NAME --model DIR [...]

`--model` (or `--tokenizer`) is a directory with the tokenizer files only —
tokenizer.json, tokenizer_config.json, the chat template; the router never
loads weights. Each upstream is one group's stage 0 (its gRPC port), polled
like the groups of `pipeserve up` (the same ReplicaSet and app): a group that
is not ready, or not answering, leaves routing until its polls say ready again.
Discovery (router/discovery.py) says which groups exist: `--discover static`
(the default with --upstream) or `kubernetes` (an InferencePipeline's Ready
groups, followed as they change without a restart; `--namespace` defaults to
the pod's own namespace). Env: PIPESERVE_UPSTREAM, PIPESERVE_DISCOVER,
PIPESERVE_NAMESPACE, PIPESERVE_PIPELINE. Bad settings exit 2 (ConfigError).
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

from pipeserve.config import (
    DISCOVERY_KINDS,
    DiscoveryConfig,
    RouterConfig,
    add_config_args,
    config_from_args,
)
from pipeserve.errors import ConfigError, ExitCode
from pipeserve.router.discovery import Discovery, Static, upstream_targets

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
    r.add_argument(
        "--discover",
        choices=DISCOVERY_KINDS,
        default=os.environ.get("PIPESERVE_DISCOVER") or None,
        help="where the groups come from (default: static, the --upstream list)",
    )
    r.add_argument(
        "--namespace",
        default=os.environ.get("PIPESERVE_NAMESPACE") or None,
        help="kubernetes: the InferencePipeline's namespace (default: this pod's, else 'default')",
    )
    r.add_argument(
        "--pipeline", default=os.environ.get("PIPESERVE_PIPELINE", ""), help="kubernetes: its name"
    )
    r.add_argument("--kube-api", default=None, help="kubernetes: API server URL, no auth (tests, dev)")
    r.add_argument("--drain-timeout-s", type=float, default=30.0, help="SIGTERM: let responses finish")
    add_config_args(r, RouterConfig, skip=_FIXED)
    r.set_defaults(func=run_router)


def discovery_config(args: argparse.Namespace) -> DiscoveryConfig:
    kind = args.discover or "static"
    if kind == "static":
        upstream_targets(args.upstream)  # the precise message for a bad host:port
        return DiscoveryConfig(kind=kind, upstream=args.upstream)
    from pipeserve.router.discovery_k8s import pod_namespace  # stdlib only until run

    return DiscoveryConfig(
        kind=kind,
        upstream=args.upstream or None,
        namespace=args.namespace or pod_namespace(),
        pipeline=args.pipeline,
        kube_api=args.kube_api,
    )


def make_discovery(config: DiscoveryConfig) -> Discovery:
    """The discovery `config` names; the kubernetes client is imported only when asked for."""
    if config.kind == "static":
        return Static(upstream_targets(config.upstream))
    from pipeserve.router.discovery_k8s import Kubernetes

    return Kubernetes(config)


async def serve_router(config: RouterConfig, discovery: Discovery, drain_timeout_s: float) -> int:
    from pipeserve.router.app import build_app
    from pipeserve.router.http_guard import RouterServer, server_config
    from pipeserve.router.replicas import ReplicaSet

    class Server(RouterServer):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the loop's handlers below decide: a second signal skips the drain

    registry = CollectorRegistry()
    replicas = ReplicaSet(config, {}, registry)
    app = build_app(config, replicas, registry)
    server = Server(server_config(app, config, timeout_graceful_shutdown=drain_timeout_s))

    def on_signal() -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await replicas.start()
    watcher = asyncio.create_task(discovery.run(replicas.set_targets), name="router-discovery")
    try:
        await server.serve()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await replicas.close()
    return ExitCode.OK


def run_router(args: argparse.Namespace) -> int:
    if not args.model:
        raise ConfigError("model: the tokenizer directory is required (--model or --tokenizer)")
    if args.drain_timeout_s < 0:
        raise ConfigError(f"drain_timeout_s: must be >= 0 (got {args.drain_timeout_s})")
    config = config_from_args(RouterConfig, args, skip=_FIXED, model=args.model)
    discovery = make_discovery(discovery_config(args))
    from pipeserve.obs.tracing import setup_tracing

    traces = setup_tracing("pipeserve-router")
    try:
        return asyncio.run(serve_router(config, discovery, args.drain_timeout_s))
    finally:
        traces.shutdown(deadline_s=3.0)
