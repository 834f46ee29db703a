"""Where the router's groups come from (DiscoveryConfig, ModelEntry) and how `pipeserve up`'s
supervisor watches its groups (SupervisorConfig). Fields are declared with `opt` (fields.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipeserve.config.fields import REQUIRED, check_ranges, checker, opt
from pipeserve.config.serving import POLICIES
from pipeserve.env import PIPELINE, UPSTREAM

DISCOVERY_KINDS = ("static", "kubernetes")
_K8S_NAME = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # RFC 1123 label: a namespace or an object name
R = "router"


@dataclass(frozen=True)
class ModelEntry:
    """One model of `pipeserve router --models FILE` (router/upstream/models_file.py reads the file): the name
    clients send, its tokenizer, and where its groups come from: an InferencePipeline (`pipeline`, with
    --discover kubernetes) or host:port list (`upstream`, static). `policy` None: --policy if given,
    else the InferencePipeline's spec.router.policy, else round_robin."""

    model: str = opt(REQUIRED, "the served name: a request's `model`, an entry of /v1/models", group=R)
    tokenizer: str = opt(REQUIRED, "directory with the tokenizer files", group=R)
    pipeline: str = opt("", "kubernetes: the InferencePipeline's name", group=R)
    upstream: str | None = opt(None, "static: host:port[,host:port...]", group=R)
    chat_template: str | None = opt(
        None, "a file path or the template text", group=R, shown="the tokenizer's"
    )
    policy: str | None = opt(None, "how a group is picked", group=R, choices=POLICIES, shown="see above")

    def __post_init__(self) -> None:
        need = checker(self)
        need(bool(self.model) and self.model == self.model.strip(), "model", "must be a non-empty name")
        need(Path(self.tokenizer).is_dir(), "tokenizer", "must be a directory with the tokenizer files")
        need(
            not self.pipeline or bool(re.fullmatch(_K8S_NAME, self.pipeline)),
            "pipeline",
            "must be an InferencePipeline name",
        )
        need(self.chat_template is None or bool(self.chat_template), "chat_template", "must not be empty")
        need(self.policy is None or self.policy in POLICIES, "policy", f"must be one of {POLICIES}")


@dataclass(frozen=True)
class DiscoveryConfig:
    """How `pipeserve router` finds its groups: a fixed --upstream list, or an InferencePipeline's status."""

    kind: str = opt("static", "where the groups come from", group=R, choices=DISCOVERY_KINDS)
    upstream: str | None = opt(
        None, "static: every group's stage 0 gRPC address, host:port[,host:port...]", group=R, env=UPSTREAM
    )
    namespace: str = opt("default", "kubernetes: the InferencePipeline's namespace", group=R)
    pipeline: str = opt(
        "", "kubernetes: the InferencePipeline's name", group=R, env=PIPELINE, chart="router.pipeline"
    )
    kube_api: str | None = opt(
        None,
        "kubernetes: an API server URL used without auth (tests, dev)",
        group=R,
        shown="in-cluster, else kubeconfig",
    )
    watch_timeout_s: float = opt(
        60.0,
        "one watch call's server-side timeout; the client reads at most +request_timeout_s",
        group=R,
        unit="s",
        range="> 0",
        internal=True,
    )
    request_timeout_s: float = opt(
        10.0,
        "deadline of a list call, and the margin on a watch's",
        group=R,
        unit="s",
        range="> 0",
        internal=True,
    )
    backoff_s: float = opt(
        0.5,
        "after a failed list/watch; doubles per failure in a row",
        group=R,
        unit="s",
        range="> 0",
        internal=True,
    )
    backoff_max_s: float = opt(10.0, "the backoff's cap", group=R, unit="s", range="> 0", internal=True)

    def __post_init__(self) -> None:
        need = checker(self)
        need(self.kind in DISCOVERY_KINDS, "kind", f"must be one of {DISCOVERY_KINDS}")
        check_ranges(self)
        need(self.backoff_max_s >= self.backoff_s, "backoff_max_s", "must be >= backoff_s")
        if self.kind == "static":
            need(bool(self.upstream), "upstream", "need at least one host:port (--upstream)")
            return
        need(not self.upstream, "upstream", "is for --discover static only")
        need(bool(re.fullmatch(_K8S_NAME, self.namespace)), "namespace", "must be a Kubernetes name")
        need(bool(re.fullmatch(_K8S_NAME, self.pipeline)), "pipeline", "must be an InferencePipeline name")
        need(
            self.kube_api is None or self.kube_api.startswith(("http://", "https://")),
            "kube_api",
            "must be an http(s):// URL",
        )


V = "supervision"


@dataclass(frozen=True)
class SupervisorConfig:
    """How `pipeserve up`'s supervisor watches its groups (the operator will read the same fields)."""

    interval_s: float = opt(
        0.5, "every group is looked at this often", group=V, unit="s", range="> 0", internal=True
    )
    probe_timeout_s: float = opt(
        1.0, "deadline of one /livez or /readyz call", group=V, unit="s", range="> 0", internal=True
    )
    backoff_s: float = opt(
        1.0, "delay before the first restart; doubles per failure in a row", group=V, unit="s", range="> 0"
    )
    backoff_max_s: float = opt(30.0, "the restart delay's cap", group=V, unit="s", range="> 0")
    stable_s: float = opt(
        60.0, "a group ready this long is forgiven its past failures", group=V, unit="s", range="> 0"
    )
    kill_grace_s: float = opt(3.0, "SIGTERM, then SIGKILL after this", group=V, unit="s", range="> 0")
    start_grace_s: float = opt(
        30.0,
        "a new incarnation's side ports may not answer yet for this long",
        group=V,
        unit="s",
        range="> 0",
        internal=True,
    )
    ready_margin_s: float = opt(
        30.0,
        "not ready connect_timeout_s + this after its start: restart",
        group=V,
        unit="s",
        range="> 0",
        internal=True,
    )
    # A stage frozen too hard to exit by itself (SIGSTOP).
    unanswered_margin_s: float = opt(
        5.0,
        "restart when /livez is silent longer than the stage's own wedge timeout + grace + this",
        group=V,
        unit="s",
        range="> 0",
        internal=True,
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        checker(self)(self.backoff_max_s >= self.backoff_s, "backoff_max_s", "must be >= backoff_s")
