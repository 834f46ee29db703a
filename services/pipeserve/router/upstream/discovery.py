"""Where `pipeserve router`'s groups come from: a fixed list, or a Kubernetes InferencePipeline.

Contract: a `Discovery` has one coroutine, `run(apply)`, run as a task in the
loop that serves requests. It calls `apply(targets)` (targets = group name ->
stage 0's "host:port"; typically `ReplicaSet.set_targets`) in that loop,
first with the initial set and then on every change, and never returns until
cancelled; cancelling it stops whatever it started (threads, calls) within
its own deadlines. `apply` is never called with an invalid target.

* `Static` (`--upstream h:p,h:p`): groups "group-0", "group-1", ... in the
  order given, applied once.
* `Kubernetes` (discovery_k8s.py, `--discover kubernetes`): the groups of one
  InferencePipeline's status that are Ready and have an endpoint.

Discovery only says which groups may be routed to: the ReplicaSet still polls
each group's Health and routes to it only while it answers ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from pipeserve.errors import ConfigError

Apply = Callable[[dict[str, str]], None]


class Discovery(Protocol):
    async def run(self, apply: Apply) -> None: ...


def upstream_targets(text: str | None) -> dict[str, str]:
    """'h:p,h:p' -> {"group-0": "h:p", ...}, each checked."""
    if not text:
        raise ConfigError("upstream: need at least one host:port (--upstream or PIPESERVE_UPSTREAM)")
    targets = {}
    for i, part in enumerate(p.strip() for p in text.split(",")):
        if not valid_target(part):
            raise ConfigError(f"upstream: expected host:port (got {part!r})")
        targets[f"group-{i}"] = part
    return targets


def valid_target(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


class Static:
    def __init__(self, targets: dict[str, str]) -> None:
        self.targets = dict(targets)

    async def run(self, apply: Apply) -> None:
        apply(dict(self.targets))
        await asyncio.Event().wait()  # nothing ever changes; ends by cancellation
