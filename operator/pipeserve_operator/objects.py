"""The objects a pipeline owns, ensured on every reconcile (not only when the spec changes).

    await ensure_group(writer, pipeline, spec, index, generation, live_sts, network_policies)
    await ensure_pdb(writer, pipeline)          await ensure_pod_groups(writer, pipeline, indices, spec_of)

Every object carries the pipeline's owner reference (the garbage collector removes them with it).
* Per group: the headless Service, the NetworkPolicy (`--network-policies`), the StatefulSet and,
  with `spec.placement.gang: volcano`, a Volcano PodGroup (`minMember` = stages, `minResources` =
  stages × the stage's requests). A missing one is created; one that differs from the rendering (a
  hand edit, a new operator version, a new spec, a removed field) is replaced whole (writes.py).
  Replacing the template never replaces a pod (OnDelete): groups roll only when their pods'
  `pipeserve.io/spec-hash` differs from `spec_hash(spec)` — the user's spec, so an operator upgrade
  that only changes the rendering rolls nothing.
* Per pipeline: a PodDisruptionBudget over all its stage pods (`maxUnavailable: 1`: a drain evicts one
  stage, i.e. takes one group down, at a time; `unhealthyPodEvictionPolicy: AlwaysAllow`: a group that is
  not Ready anyway never blocks a node drain).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from pipeserve_operator.crd import with_defaults
from pipeserve_operator.observe import HASH_ANNOTATION
from pipeserve_operator.resources import (
    group_name,
    group_network_policy,
    group_selector,
    owner_reference,
    pipeline_selector,
    pod_group_name,
    stage_service,
    stage_statefulset,
)
from pipeserve_operator.spec import PipelineSpec
from pipeserve_operator.writes import Writer

# Spec fields that never change what a group runs: how many groups, how they roll, the router, backoffs.
_NOT_ROLLED = ("replicas", "rollout", "router", "restartBackoffSeconds", "restartBackoffMaxSeconds")
NOT_ROLLED = _NOT_ROLLED  # canary.py: what every group takes from the resource, whatever its revision
# Pod-spec keys the API server never defaults in a template: present on the live template while the
# rendering has none = added by hand (drift a hash of the rendering cannot see).
TEMPLATE_KEYS_CLEARED = (
    "nodeSelector",
    "tolerations",
    "affinity",
    "priorityClassName",
    "runtimeClassName",
    "serviceAccountName",
    "imagePullSecrets",
    "topologySpreadConstraints",
)
SURGE_ANNOTATION = "pipeserve.io/surge"  # on a StatefulSet created as a rollout's surge group


def is_surge(sts: dict[str, Any]) -> bool:
    return ((sts.get("metadata") or {}).get("annotations") or {}).get(SURGE_ANNOTATION) == "true"


def spec_hash(spec: dict[str, Any]) -> str:
    """The hash of what a group runs: the spec with defaults, less the fields in `_NOT_ROLLED`."""
    full = {k: v for k, v in with_defaults(spec).items() if k not in _NOT_ROLLED}
    return hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:16]


def desired_statefulset(pipeline: dict, spec: PipelineSpec, index: int, generation: int) -> dict[str, Any]:
    """`pipeline`: the CR as group `index` renders it (canary.py's view: its JSON spec is what the pods'
    hash is taken of, unchanged across operator versions); `spec`: that spec, typed."""
    desired = stage_statefulset(pipeline, spec, index, max(1, generation))
    template = desired["spec"]["template"]
    template["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = spec_hash(pipeline["spec"])
    return desired


def _hand_added(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    have = (live["spec"].get("template") or {}).get("spec") or {}
    return any(k in have for k in TEMPLATE_KEYS_CLEARED if k not in desired["spec"]["template"]["spec"])


async def ensure_group(
    writer: Writer,
    pipeline: dict,
    spec: PipelineSpec,
    index: int,
    generation: int,
    live: dict | None,
    network_policies: bool,
    stopped: bool = False,
    surge: bool = False,
) -> bool:
    """Create or replace the group's objects (writes.py: whole, drift only); True when its StatefulSet
    exists after this. `generation`: the group's current incarnation (the template's generation label);
    `live`: its StatefulSet as listed this tick (None: none); `stopped`: the group waits out a backoff
    (created with no pods: the supervisor's START scales it up); `surge`: created as a rollout's surge
    group (the mark is kept on every later replace)."""
    name = group_name(pipeline, index)
    await writer.ensure(stage_service(pipeline, index), writer.view.get("Service", name))
    if network_policies:
        policy = writer.view.get("NetworkPolicy", name)
        await writer.ensure(group_network_policy(pipeline, index), policy)
    desired = desired_statefulset(pipeline, spec, index, generation)
    if live is None:
        if stopped:
            desired["spec"]["replicas"] = 0
        if surge:
            desired["metadata"]["annotations"] = {SURGE_ANNOTATION: "true"}
        return await writer.ensure(desired, None)
    return await writer.ensure(desired, live, drift=_hand_added(live, desired))


def disruption_budget(pipeline: dict) -> dict[str, Any]:
    meta = pipeline["metadata"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": {**pipeline_selector(pipeline), "app.kubernetes.io/managed-by": "pipeserve-operator"},
            "ownerReferences": [owner_reference(pipeline)],
        },
        "spec": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": pipeline_selector(pipeline)},
        },
    }


async def ensure_pdb(writer: Writer, pipeline: dict) -> None:
    desired = disruption_budget(pipeline)
    await writer.ensure(desired, writer.view.get("PodDisruptionBudget", desired["metadata"]["name"]))


def _times(quantity: Any, n: int) -> str:
    total = parse_quantity(quantity) * n
    return str(int(total)) if total == total.to_integral_value() else f"{int(total * Decimal(1000))}m"


def pod_group(pipeline: dict, spec: PipelineSpec, index: int) -> dict[str, Any]:
    """The Volcano PodGroup of group `index`: all `stages` pods are scheduled together or not at all."""
    requests = (spec.resources.requests if spec.resources is not None else None) or {}
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": {
            "name": pod_group_name(pipeline, index),
            "namespace": pipeline["metadata"]["namespace"],
            "labels": {
                **group_selector(pipeline, index),
                "app.kubernetes.io/managed-by": "pipeserve-operator",
            },
            "ownerReferences": [owner_reference(pipeline)],
        },
        "spec": {
            "minMember": spec.stages,
            "minResources": {k: _times(v, spec.stages) for k, v in sorted(requests.items())},
        },
    }


async def ensure_pod_groups(
    writer: Writer, pipeline: dict, indices: list[int], spec_of: Callable[[int], PipelineSpec]
) -> None:
    """With gang "volcano": a PodGroup for each group in `indices`; none for any other group (scaled
    away) and none at all under another gang mode (a pipeline switched from volcano to none or kueue).
    `spec_of(i)`: the typed spec group i renders (canary.py: a group below rollout.partition keeps the
    previous spec, its gang mode and size included). NotFound: the PodGroup API is not served (raised
    by the create, so only when PodGroups are wanted: without Volcano the index is empty)."""
    ns = pipeline["metadata"]["namespace"]
    specs = {i: spec_of(i) for i in indices}
    wanted = {
        pod_group_name(pipeline, i): pod_group(pipeline, s, i)
        for i, s in specs.items()
        if s.placement.gang == "volcano"
    }
    live = {g["metadata"]["name"]: g for g in writer.view.list("PodGroup")}
    for name, desired in wanted.items():
        await writer.ensure(desired, live.get(name))
    for name in sorted(set(live) - set(wanted)):
        await writer.kube.delete_pod_group(ns, name)
