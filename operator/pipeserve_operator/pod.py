"""The stage pod's device, customization and placement (pure functions of the defaulted spec).

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

GPU_RESOURCE = "nvidia.com/gpu"
# The spec's choices (the CRD's enums are these): spec.device, placement.colocate, placement.gang.
DEVICES = ("auto", "cpu", "cuda")
COLOCATE = ("preferred", "required", "none")
GANGS = ("none", "volcano", "kueue")
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


def stage_device(spec: dict[str, Any]) -> str:
    if spec.get("device", "auto") != "auto":
        return str(spec["device"])
    resources = spec.get("resources") or {}
    for kind in ("limits", "requests"):
        if _positive((resources.get(kind) or {}).get(GPU_RESOURCE, 0)):
            return "cuda"
    return "cpu"


def check_owned_names(spec: dict[str, Any]) -> None:
    """The builders' copy of the CRD's CEL rules (owned.py): a CR stored before a rule existed, or sent
    to an API server that skipped it, is refused here with the field's name."""
    for i, env in enumerate(spec.get("env") or []):
        if env.get("name") in OWNED_ENV:
            raise SpecError(f"env[{i}].name: {env['name']} is set by the operator")
    for i, vol in enumerate(spec.get("volumes") or []):
        if vol.get("name") in OWNED_VOLUMES:
            raise SpecError(f"volumes[{i}].name: {vol['name']} is a volume of the operator's")
    model = spec.get("model") or {}
    owned_paths = set(OWNED_MOUNT_PATHS)
    if model.get("persistentVolumeClaim") or model.get("hostPath"):
        owned_paths.add(model.get("mountPath", "/models"))
    for i, mount in enumerate(spec.get("volumeMounts") or []):
        if mount.get("name") in OWNED_VOLUMES:
            raise SpecError(f"volumeMounts[{i}].name: {mount['name']} is a volume of the operator's")
        if mount.get("mountPath") in owned_paths:
            raise SpecError(f"volumeMounts[{i}].mountPath: {mount['mountPath']} is mounted by the operator")
    for field, owned in (("podLabels", OWNED_LABELS), ("podAnnotations", OWNED_ANNOTATIONS)):
        for key in spec.get(field) or {}:
            if key.startswith(OWNED_LABEL_PREFIX) or key in owned:
                raise SpecError(f"{field}.{key}: a key the operator sets")
    gang = (spec.get("placement") or {}).get("gang", "none")
    if gang == "volcano" and spec.get("schedulerName", "volcano") != "volcano":
        raise SpecError("schedulerName: placement.gang volcano schedules with volcano")
    if gang == "kueue" and not (spec.get("placement") or {}).get("queueName"):
        raise SpecError("placement.queueName: required when placement.gang is kueue")


def pod_volumes(spec: dict[str, Any], device: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    model = spec["model"]
    if model.get("persistentVolumeClaim"):
        pvc = {"claimName": model["persistentVolumeClaim"], "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": pvc})
    elif model.get("hostPath"):
        volumes.append({"name": "model", "hostPath": {"path": model["hostPath"], "type": "Directory"}})
    if volumes[-1]["name"] == "model":
        mounts.append({"name": "model", "mountPath": model["mountPath"], "readOnly": True})
    if device == "cuda":
        size = spec.get("shmSizeLimit", "1Gi")
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        mounts.append({"name": "dshm", "mountPath": SHM_PATH})
    volumes += copy.deepcopy(spec.get("volumes") or [])
    mounts += copy.deepcopy(spec.get("volumeMounts") or [])
    return volumes, mounts


def pod_affinity(spec: dict[str, Any], group_labels: dict[str, str]) -> dict[str, Any] | None:
    """The spec's affinity, deep-copied, with the group's co-location term appended to its podAffinity
    (the user's own terms are kept)."""
    affinity = copy.deepcopy(spec.get("affinity") or {})
    placement = spec.get("placement") or {}
    colocate = placement.get("colocate", "preferred")
    if colocate != "none":
        term = {
            "labelSelector": {"matchLabels": dict(group_labels)},
            "topologyKey": placement.get("topologyKey", "kubernetes.io/hostname"),
        }
        pod_aff = affinity.setdefault("podAffinity", {})
        if colocate == "required":
            pod_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
        else:
            weighted = {"weight": 100, "podAffinityTerm": term}
            pod_aff.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(weighted)
    return affinity or None


def gang_metadata(
    spec: dict[str, Any], pod_group: str, stages: int
) -> tuple[dict[str, str], dict[str, str], str | None]:
    """(labels, annotations, schedulerName) that make a gang scheduler place a group's pods together."""
    placement = spec.get("placement") or {}
    gang = placement.get("gang", "none")
    if gang == "volcano":
        return {}, {VOLCANO_GROUP_ANNOTATION: pod_group}, "volcano"
    if gang == "kueue":
        labels = {KUEUE_GROUP_LABEL: pod_group, KUEUE_QUEUE_LABEL: placement["queueName"]}
        return labels, {KUEUE_COUNT_ANNOTATION: str(stages)}, None
    return {}, {}, None


def customize(pod_spec: dict[str, Any], spec: dict[str, Any]) -> None:
    for key in PASSED_THROUGH:
        if spec.get(key):
            pod_spec[key] = copy.deepcopy(spec[key])
