"""Pods of a group → `pipeserve.care.restarts.GroupObservation` (what `decide` reads).

Per pod (stage = `apps.kubernetes.io/pod-index`, else the name's ordinal suffix):
* generation: the `pipeserve.io/group-generation` label (absent or unreadable: -1, i.e. stale);
* state: phase Pending → PENDING, Running → RUNNING, Succeeded/Failed → EXITED;
* ready: the pod's Ready condition is True;
* restarts / exit_code: the `stage` container's restartCount and its last termination's exit code.
  A liveness-probe failure (a wedged stage: /livez red) makes the kubelet restart the container, so a
  wedge shows here as a restart; a container waiting in CrashLoopBackOff shows the same way;
* deleting: the pod has a deletionTimestamp;
* outdated: the pod's `pipeserve.io/spec-hash` annotation differs from the hash of the pipeline's
  current spec (`objects.spec_hash`: the user's spec, not the rendered template, so an operator upgrade
  alone rolls nothing; `decide` rolls the group when the fleet rules allow it).
A stage that stays not Ready is left to `decide`'s startup deadline (a Ready group that loses a ready
stage goes back to Starting with a fresh deadline), so no separate not-ready timer lives here.
"""

from __future__ import annotations

from typing import Any

from pipeserve.care.restarts import GroupObservation, StageObservation, StageState
from pipeserve_operator.resources import GENERATION_LABEL, GROUP_LABEL, POD_INDEX_LABEL

HASH_ANNOTATION = "pipeserve.io/spec-hash"
_STATES = {"Pending": StageState.PENDING, "Running": StageState.RUNNING}


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def pod_rank(pod: dict[str, Any]) -> int:
    meta = pod.get("metadata") or {}
    rank = _int((meta.get("labels") or {}).get(POD_INDEX_LABEL), -1)
    return rank if rank >= 0 else _int(str(meta.get("name", "")).rsplit("-", 1)[-1], -1)


def pod_generation(pod: dict[str, Any]) -> int:
    return _int(((pod.get("metadata") or {}).get("labels") or {}).get(GENERATION_LABEL), -1)


def pod_group(pod: dict[str, Any]) -> int:
    return _int(((pod.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL), -1)


def template_hash(obj: dict[str, Any]) -> str | None:
    """The spec hash a pod (or a pod template's metadata holder) carries (None: none)."""
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)


def stage_observation(pod: dict[str, Any], wanted_hash: str | None = None) -> StageObservation:
    status = pod.get("status") or {}
    state = _STATES.get(status.get("phase", "Pending"), StageState.EXITED)
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    restarts, exit_code = 0, None
    for cs in status.get("containerStatuses") or []:
        restarts += _int(cs.get("restartCount"), 0)
        terminated = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get(
            "terminated"
        )
        if terminated and terminated.get("exitCode") is not None:
            exit_code = _int(terminated["exitCode"], -1)
    return StageObservation(
        rank=pod_rank(pod),
        generation=pod_generation(pod),
        state=state,
        ready=ready,
        restarts=restarts,
        exit_code=exit_code,
        deleting=bool((pod.get("metadata") or {}).get("deletionTimestamp")),
        outdated=wanted_hash is not None and template_hash(pod) != wanted_hash,
    )


def group_observation(
    pods: list[dict[str, Any]], world_size: int, wanted_hash: str | None = None
) -> GroupObservation:
    """The observation of one group from its pods (any generation; ranks outside 0..S-1 are ignored);
    `wanted_hash`: the current spec's hash (None: never outdated)."""
    stages = [stage_observation(p, wanted_hash) for p in pods]
    return GroupObservation(world_size, tuple(s for s in stages if 0 <= s.rank < world_size))
