"""`pipeserve router`: the router as its own process (what a router Deployment runs).

    pipeserve router --upstream HOST:PORT[,HOST:PORT...] --model DIR [RouterConfig flags]
    pipeserve router --discover kubernetes [--namespace NS] --pipeline NAME --model DIR [...]
    pipeserve router --discover kubernetes --models FILE [...]     # several models (models_file.py)

`--model` (or `--tokenizer`) is a directory with the tokenizer files only —
tokenizer.json, tokenizer_config.json, the chat template; the router never
loads weights. Each upstream is one group's stage 0 (its gRPC port), polled
like the groups of `pipeserve up` (the same ReplicaSet and app): a group that
is not ready, or not answering, leaves routing until its polls say ready again.
Discovery (router/upstream/discovery.py) says which groups exist: `--discover static`
(the default with --upstream) or `kubernetes` (an InferencePipeline's Ready
groups, followed as they change without a restart; `--namespace` defaults to
the pod's own namespace). Env: PIPESERVE_UPSTREAM, PIPESERVE_DISCOVER,
PIPESERVE_NAMESPACE, PIPESERVE_PIPELINE. Bad settings exit 2 (ConfigError).
SIGTERM/SIGINT: uvicorn's graceful shutdown, streams ended just before it.

Policy: `--policy` (or PIPESERVE_POLICY) applies to every model; without it, a --models entry's
`policy`, else (kubernetes) the InferencePipeline's `spec.router.policy`, followed live, else
round_robin. `--models FILE` serves each entry as its own router behind router/http/multi.py's front;
it replaces --model, --served-model-name, --pipeline and --upstream (naming both exits 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry

from pipeserve import env as pipeserve_env
from pipeserve.config import (
    DISCOVERY_KINDS,
    POLICIES,
    DiscoveryConfig,
    RouterConfig,
    StageServeConfig,
    add_config_args,
    config_from_args,
)
from pipeserve.config.fields import flag_help
from pipeserve.config.flags import group
from pipeserve.errors import ConfigError, ExitCode
from pipeserve.router.upstream.discovery import Discovery, Static, upstream_targets

DISCOVERY_NOT_FLAGS = {f.name for f in fields(DiscoveryConfig)} - {"upstream", "pipeline", "kube_api"}
_FIXED = {"model", "policy"}  # own flags below: --policy's absence matters (the pipeline's then)


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("router", help="the OpenAI-compatible router alone, in front of running groups")
    own, E = group(r, "router"), pipeserve_env
    own.add_argument(
        "--model",
        "--tokenizer",
        dest="model",
        default=E.get(E.MODEL),
        metavar="DIR",
        help=flag_help("directory with the tokenizer files (no weights needed)", "required", E.MODEL),
    )
    own.add_argument(
        "--discover",
        choices=DISCOVERY_KINDS,
        default=E.get(E.DISCOVER),
        help=flag_help("where the groups come from", "static, the --upstream list", E.DISCOVER),
    )
    own.add_argument(
        "--namespace",
        default=E.get(E.NAMESPACE),
        help=flag_help(
            "kubernetes: the InferencePipeline's namespace", "this pod's, else default", E.NAMESPACE
        ),
    )
    own.add_argument(
        "--models",
        default=E.get(E.MODELS),
        metavar="FILE",
        help=flag_help(
            "YAML/JSON list of served models, each its own tokenizer and pipeline (docs/kubernetes.md)",
            "none",
            E.MODELS,
        ),
    )
    own.add_argument(
        "--policy",
        choices=POLICIES,
        default=E.get(E.POLICY),
        help=flag_help(
            "how a group is picked", "the pipeline's spec.router.policy, else round_robin", E.POLICY
        ),
    )
    # --upstream, --pipeline, --kube-api; --drain-timeout-s as a stage's
    add_config_args(r, DiscoveryConfig, skip=DISCOVERY_NOT_FLAGS)
    add_config_args(
        r, StageServeConfig, skip={f.name for f in fields(StageServeConfig)} - {"drain_timeout_s"}
    )
    add_config_args(r, RouterConfig, skip=_FIXED)
    r.set_defaults(func=run_router)


def discovery_config(
    args: argparse.Namespace, pipeline: str | None = None, upstream: str | None = None
) -> DiscoveryConfig:
    """The discovery of the flags (or of one --models entry: its `pipeline` / `upstream`)."""
    kind = args.discover or "static"
    upstream = upstream if upstream is not None else args.upstream
    if kind == "static":
        upstream_targets(upstream)  # the precise message for a bad host:port
        return DiscoveryConfig(kind=kind, upstream=upstream)
    from pipeserve.router.upstream.discovery_k8s import pod_namespace  # stdlib only until run

    return DiscoveryConfig(
        kind=kind,
        upstream=upstream or None,
        namespace=args.namespace or pod_namespace(),
        pipeline=pipeline if pipeline is not None else args.pipeline,
        kube_api=args.kube_api,
    )


def make_discovery(
    config: DiscoveryConfig, on_policy: Callable[[str | None], None] | None = None
) -> Discovery:
    """The discovery `config` names; the kubernetes client is imported only when asked for.
    `on_policy` gets the InferencePipeline's spec.router.policy (kubernetes only)."""
    if config.kind == "static":
        return Static(upstream_targets(config.upstream))
    from pipeserve.router.upstream.discovery_k8s import Kubernetes

    return Kubernetes(config, on_policy)


@dataclass
class Model:
    """One served model as run_router resolved it: its config, discovery and explicit policy."""

    config: RouterConfig
    discovery: DiscoveryConfig
    policy: str | None  # named by --policy or the --models entry: the pipeline's spec is then ignored


async def serve_router(models: list[Model], drain_timeout_s: float) -> int:
    from pipeserve.router.http.app import build_app
    from pipeserve.router.http.http_guard import RouterServer, server_config
    from pipeserve.router.http.multi import ModelRouter, Served
    from pipeserve.router.upstream.replicas import ReplicaSet

    class Server(RouterServer):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the loop's handlers below decide: a second signal skips the drain

    served, sets, discoveries = [], [], []
    for m in models:
        registry = CollectorRegistry()
        replicas = ReplicaSet(m.config, {}, registry)
        on_policy = None
        if m.policy is None:  # the pipeline's own policy, live; round_robin while it names none

            def on_policy(policy: str | None, replicas: ReplicaSet = replicas) -> None:
                replicas.policy = policy or replicas.config.policy

        discoveries.append((make_discovery(m.discovery, on_policy), replicas))
        sets.append(replicas)
        served.append(Served(m.config.model_name, build_app(m.config, replicas, registry), registry))
    config = models[0].config
    app: Any = served[0].app
    if len(served) > 1:
        app = ModelRouter(served, config.api_key, config.body_timeout_s)
    server = Server(server_config(app, config, timeout_graceful_shutdown=drain_timeout_s))

    def on_signal() -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    for replicas in sets:
        await replicas.start()
    watchers = [
        asyncio.create_task(d.run(r.set_targets), name=f"router-discovery-{i}")
        for i, (d, r) in enumerate(discoveries)
    ]
    try:
        await server.serve()
    finally:
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        for replicas in sets:
            await replicas.close()
    return ExitCode.OK


def resolve_models(args: argparse.Namespace) -> list[Model]:
    """The models the flags say to serve: the --models file's entries, else the single model."""
    policy = args.policy or "round_robin"
    if not args.models:
        if not args.model:
            raise ConfigError("model: the tokenizer directory is required (--model or --tokenizer)")
        config = config_from_args(RouterConfig, args, skip=_FIXED, model=args.model, policy=policy)
        return [Model(config, discovery_config(args), args.policy)]
    clash = [f for f in ("model", "served_model_name", "pipeline", "upstream") if getattr(args, f)]
    if clash:
        raise ConfigError(f"models: --models replaces --{clash[0].replace('_', '-')} (each entry says it)")
    from pipeserve.router.upstream.models_file import load_models

    models = []
    for e in load_models(args.models, args.discover or "static"):
        config = config_from_args(
            RouterConfig,
            args,
            skip=_FIXED | {"served_model_name", "chat_template"},
            model=e.tokenizer,
            served_model_name=e.model,
            chat_template=e.chat_template or args.chat_template,
            policy=args.policy or e.policy or "round_robin",
        )
        discovery = discovery_config(args, pipeline=e.pipeline, upstream=e.upstream or "")
        models.append(Model(config, discovery, args.policy or e.policy))
    return models


def run_router(args: argparse.Namespace) -> int:
    if args.drain_timeout_s < 0:
        raise ConfigError(f"drain_timeout_s: must be >= 0 (got {args.drain_timeout_s})")
    models = resolve_models(args)
    from pipeserve.obs.tracing import setup_tracing

    traces = setup_tracing("pipeserve-router")
    try:
        return asyncio.run(serve_router(models, args.drain_timeout_s))
    finally:
        traces.shutdown(deadline_s=3.0)
