"""The objects a pipeline owns, ensured on every tick (not only when the spec changes).

    await ensure_group(kube, pipeline, index, generation, live_sts, network_policies)
    await ensure_pdb(kube, pipeline)            await ensure_pod_groups(kube, pipeline, indices)

Every object carries the pipeline's owner reference (the garbage collector removes them with it).
* Per group: the headless Service, the NetworkPolicy (`--network-policies`), the StatefulSet and,
  with `spec.placement.gang: volcano`, a Volcano PodGroup (`minMember` = stages, `minResources` =
  stages × the stage's requests). A missing one is created; a StatefulSet whose pod template differs
  from the rendering (a hand edit, a new operator version, a new spec) is patched back. Patching the
  template never replaces a pod (OnDelete): groups roll only when their pods' `pipeserve.io/spec-hash`
  differs from `spec_hash(spec)` — the user's spec, so an operator upgrade that only changes the
  rendering rolls nothing.
* Per pipeline: a PodDisruptionBudget over all its stage pods (`maxUnavailable: 1`: a drain evicts one
  stage, i.e. takes one group down, at a time; `unhealthyPodEvictionPolicy: AlwaysAllow`: a group that is
  not Ready anyway never blocks a node drain).
"""

from __future__ import annotations

import hashlib
import json
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from pipeserve_operator.crd import with_defaults
from pipeserve_operator.kube import Kube
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

# Spec fields that never change what a group runs: how many groups, how they roll, the router, backoffs.
_NOT_ROLLED = ("replicas", "rollout", "router", "restartBackoffSeconds", "restartBackoffMaxSeconds")
TEMPLATE_KEYS_CLEARED = ("nodeSelector", "tolerations", "affinity")
SURGE_ANNOTATION = "pipeserve.io/surge"  # on a StatefulSet created as a rollout's surge group


def is_surge(sts: dict[str, Any]) -> bool:
    return ((sts.get("metadata") or {}).get("annotations") or {}).get(SURGE_ANNOTATION) == "true"


def spec_hash(spec: dict[str, Any]) -> str:
    """The hash of what a group runs: the spec with defaults, less the fields in `_NOT_ROLLED`."""
    full = {k: v for k, v in with_defaults(spec).items() if k not in _NOT_ROLLED}
    return hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:16]


def contains(live: Any, want: Any) -> bool:
    """`want` is found in `live` (dicts: every key of `want`, recursively; lists: same length, item by
    item): the API server's defaulted fields on `live` are not drift."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(contains(live.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(map(contains, live, want))
    return bool(live == want or (want is not None and str(live) == str(want) and type(live) is not bool))


def desired_statefulset(pipeline: dict, index: int, generation: int) -> dict[str, Any]:
    desired = stage_statefulset(pipeline, index, max(1, generation))
    template = desired["spec"]["template"]
    template["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = spec_hash(pipeline["spec"])
    return desired


def _drifted(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    have, want = live["spec"].get("template") or {}, desired["spec"]["template"]
    if not contains(have, want):
        return True
    return any(k in (have.get("spec") or {}) for k in TEMPLATE_KEYS_CLEARED if k not in want["spec"])


async def ensure_group(
    kube: Kube,
    pipeline: dict,
    index: int,
    generation: int,
    live: dict | None,
    network_policies: bool,
    stopped: bool = False,
    surge: bool = False,
) -> bool:
    """Create or patch back the group's objects; True when the StatefulSet was created or patched.
    `generation`: the group's current incarnation (the template's generation label); `live`: its
    StatefulSet as listed this tick (None: none); `stopped`: the group waits out a backoff (created
    with no pods: the supervisor's START scales it up); `surge`: created as a rollout's surge group."""
    ns, name = pipeline["metadata"]["namespace"], group_name(pipeline, index)
    if await kube.get_service(ns, name) is None:
        await kube.create_service(ns, stage_service(pipeline, index))
    if network_policies and await kube.get_network_policy(ns, name) is None:
        await kube.create_network_policy(ns, group_network_policy(pipeline, index))
    desired = desired_statefulset(pipeline, index, generation)
    if live is None:
        if stopped:
            desired["spec"]["replicas"] = 0
        if surge:
            desired["metadata"]["annotations"] = {SURGE_ANNOTATION: "true"}
        await kube.create_statefulset(ns, desired)
        return True
    if not _drifted(live, desired):
        return False
    template = desired["spec"]["template"]
    cleared = {k: None for k in TEMPLATE_KEYS_CLEARED if k not in template["spec"]}
    patch = {"spec": {"template": {**template, "spec": {**template["spec"], **cleared}}}}
    await kube.patch_statefulset(ns, name, patch)
    return True


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


async def ensure_pdb(kube: Kube, pipeline: dict) -> None:
    desired = disruption_budget(pipeline)
    ns, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    live = await kube.get_pdb(ns, name)
    if live is None:
        await kube.create_pdb(ns, desired)
    elif not contains(live.get("spec"), desired["spec"]):
        await kube.patch_pdb(ns, name, {"spec": desired["spec"]})


def _times(quantity: Any, n: int) -> str:
    total = parse_quantity(quantity) * n
    return str(int(total)) if total == total.to_integral_value() else f"{int(total * Decimal(1000))}m"


def pod_group(pipeline: dict, index: int) -> dict[str, Any]:
    """The Volcano PodGroup of group `index`: all `stages` pods are scheduled together or not at all."""
    spec = with_defaults(pipeline["spec"])
    requests = (spec.get("resources") or {}).get("requests") or {}
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
            "minMember": spec["stages"],
            "minResources": {k: _times(v, spec["stages"]) for k, v in sorted(requests.items())},
        },
    }


def gang(spec: dict[str, Any]) -> str:
    return str((spec.get("placement") or {}).get("gang") or "none")


async def ensure_pod_groups(kube: Kube, pipeline: dict, indices: list[int]) -> None:
    """With gang "volcano": a PodGroup for each group in `indices`, none for any other group (removed on
    scale-down)."""
    if gang(pipeline["spec"]) != "volcano":
        return  # no Volcano (maybe not even its CRD): nothing to list
    ns = pipeline["metadata"]["namespace"]
    wanted = {pod_group_name(pipeline, i): pod_group(pipeline, i) for i in indices}
    live = {g["metadata"]["name"]: g for g in await kube.list_pod_groups(ns, pipeline_selector(pipeline))}
    for name, desired in wanted.items():
        if name not in live:
            await kube.create_pod_group(ns, desired)
        elif not contains(live[name].get("spec"), desired["spec"]):
            await kube.patch_pod_group(ns, name, {"spec": desired["spec"]})
    for name in sorted(set(live) - set(wanted)):
        await kube.delete_pod_group(ns, name)
