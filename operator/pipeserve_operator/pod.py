"""The stage pod's device, customization and placement (pure functions of the typed spec, spec.py).

    stage_device(spec) -> "cuda" | "cpu"     spec.device, or auto: cuda when the stage's resources
                                             (limits or requests) ask for nvidia.com/gpu > 0
    check_owned_names(spec)                  SpecError naming the field that sets a name the operator owns
    pod_volumes(spec, device)                the operator's volumes/mounts (+ /dev/shm: cuda), then the spec's
    pod_affinity(spec, group_labels)         the spec's affinity with the group's co-location term added
    gang_metadata(spec, pod_group, stages)   (labels, annotations, schedulerName) for volcano / kueue
    customize(pod_spec, spec)                imagePullSecrets, serviceAccountName, ... copied as given

A CUDA pod gets a memory-backed emptyDir at /dev/shm (spec.shmSizeLimit): NCCL's shared-memory
transport and torch's pinned buffers need more than the container runtime's 64 MiB default.
Co-location is a podAffinity on the group's own labels: the first pod of a group matches its own term,
so even `required` schedules it; the rest follow it onto the same topology domain.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from pipeserve_operator.owned import (
    OWNED_ANNOTATIONS,
    OWNED_ENV,
    OWNED_LABEL_PREFIX,
    OWNED_LABELS,
    OWNED_MOUNT_PATHS,
    OWNED_VOLUMES,
    SpecError,
)
from pipeserve_operator.spec import COLOCATE as COLOCATE
from pipeserve_operator.spec import DEVICES as DEVICES
from pipeserve_operator.spec import GANGS as GANGS
from pipeserve_operator.spec import PipelineSpec

GPU_RESOURCE = "nvidia.com/gpu"
SHM_PATH = "/dev/shm"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
KUEUE_GROUP_LABEL, KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/pod-group-name", "kueue.x-k8s.io/queue-name"
KUEUE_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
# Fields copied into the pod spec as given (the API server validates them with the StatefulSet).
PASSED_THROUGH = (
    "imagePullSecrets",
    "serviceAccountName",
    "priorityClassName",
    "runtimeClassName",
    "schedulerName",
    "topologySpreadConstraints",
    "nodeSelector",
    "tolerations",
)
_NUMBER = re.compile(r"^\+?(\d+(\.\d*)?|\.\d+)")


def _positive(quantity: Any) -> bool:
    """Whether a Kubernetes quantity is > 0 (extended resources such as GPUs are whole numbers)."""
    if isinstance(quantity, bool):
        return False
    if isinstance(quantity, int | float):
        return quantity > 0
    match = _NUMBER.match(str(quantity).strip())
    return match is not None and float(match.group(1)) > 0


def stage_device(spec: PipelineSpec) -> str:
    if spec.device != "auto":
        return spec.device
    res = spec.resources
    for quantities in (res.limits, res.requests) if res else ():
        if _positive((quantities or {}).get(GPU_RESOURCE, 0)):
            return "cuda"
    return "cpu"


def check_owned_names(spec: PipelineSpec) -> None:
    """The builders' copy of the CRD's CEL rules (owned.py): a CR stored before a rule existed, or sent
    to an API server that skipped it, is refused here with the field's name. (env, volumes and mounts
    are core/v1 objects, JSON as given: their keys are read as such.)"""
    for i, env in enumerate(spec.env or []):
        if env.get("name") in OWNED_ENV:
            raise SpecError(f"env[{i}].name: {env['name']} is set by the operator")
    for i, vol in enumerate(spec.volumes or []):
        if vol.get("name") in OWNED_VOLUMES:
            raise SpecError(f"volumes[{i}].name: {vol['name']} is a volume of the operator's")
    owned_paths = set(OWNED_MOUNT_PATHS)
    if spec.model.persistentVolumeClaim or spec.model.hostPath:
        owned_paths.add(spec.model.mountPath)
    for i, mount in enumerate(spec.volumeMounts or []):
        if mount.get("name") in OWNED_VOLUMES:
            raise SpecError(f"volumeMounts[{i}].name: {mount['name']} is a volume of the operator's")
        if mount.get("mountPath") in owned_paths:
            raise SpecError(f"volumeMounts[{i}].mountPath: {mount['mountPath']} is mounted by the operator")
    for field, keys, owned in (
        ("podLabels", spec.podLabels, OWNED_LABELS),
        ("podAnnotations", spec.podAnnotations, OWNED_ANNOTATIONS),
    ):
        for key in keys or {}:
            if key.startswith(OWNED_LABEL_PREFIX) or key in owned:
                raise SpecError(f"{field}.{key}: a key the operator sets")
    gang = spec.placement.gang
    if gang == "volcano" and (spec.schedulerName or "volcano") != "volcano":
        raise SpecError("schedulerName: placement.gang volcano schedules with volcano")
    if gang == "kueue" and not spec.placement.queueName:
        raise SpecError("placement.queueName: required when placement.gang is kueue")


def pod_volumes(spec: PipelineSpec, device: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    model = spec.model
    if model.persistentVolumeClaim:
        pvc = {"claimName": model.persistentVolumeClaim, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": pvc})
    elif model.hostPath:
        volumes.append({"name": "model", "hostPath": {"path": model.hostPath, "type": "Directory"}})
    if volumes[-1]["name"] == "model":
        mounts.append({"name": "model", "mountPath": model.mountPath, "readOnly": True})
    if device == "cuda":
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shmSizeLimit}})
        mounts.append({"name": "dshm", "mountPath": SHM_PATH})
    volumes += copy.deepcopy(spec.volumes or [])
    mounts += copy.deepcopy(spec.volumeMounts or [])
    return volumes, mounts


def pod_affinity(spec: PipelineSpec, group_labels: dict[str, str]) -> dict[str, Any] | None:
    """The spec's affinity, deep-copied, with the group's co-location term appended to its podAffinity
    (the user's own terms are kept)."""
    affinity = copy.deepcopy(spec.affinity or {})
    placement = spec.placement
    if placement.colocate != "none":
        term = {"labelSelector": {"matchLabels": dict(group_labels)}, "topologyKey": placement.topologyKey}
        pod_aff = affinity.setdefault("podAffinity", {})
        if placement.colocate == "required":
            pod_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
        else:
            weighted = {"weight": 100, "podAffinityTerm": term}
            pod_aff.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(weighted)
    return affinity or None


def gang_metadata(
    spec: PipelineSpec, pod_group: str, stages: int
) -> tuple[dict[str, str], dict[str, str], str | None]:
    """(labels, annotations, schedulerName) that make a gang scheduler place a group's pods together."""
    placement = spec.placement
    if placement.gang == "volcano":
        return {}, {VOLCANO_GROUP_ANNOTATION: pod_group}, "volcano"
    if placement.gang == "kueue":
        labels = {KUEUE_GROUP_LABEL: pod_group, KUEUE_QUEUE_LABEL: str(placement.queueName)}
        return labels, {KUEUE_COUNT_ANNOTATION: str(stages)}, None
    return {}, {}, None


def customize(pod_spec: dict[str, Any], spec: PipelineSpec) -> None:
    for key in PASSED_THROUGH:
        value = getattr(spec, key)  # PASSED_THROUGH names PipelineSpec fields (a test checks each one)
        if value:
            pod_spec[key] = copy.deepcopy(value)
