"""The InferencePipeline CustomResourceDefinition: the one source of truth for its schema.

    python -m pipeserve_operator.crd > charts/pipeserve/crds/inferencepipeline.yaml

`crd_manifest()` is the whole CRD (apiextensions.k8s.io/v1). Defaults live only in the OpenAPI schema;
`with_defaults(spec)` applies them the way the API server does (walking the schema: a default fills a
missing field, then that field's own properties are defaulted in turn), so the operator and the chart's
tests never restate a default. What the schema cannot say (a list's length against another field, two
mutually exclusive fields) is a CEL rule (`x-kubernetes-validations`), checked by the API server.
`exclusiveMinimum` is OpenAPI v3.0's boolean form: validate examples with a Draft 4 validator. Enums
come from their one definition: group phases from `care.restarts.GroupPhase`, router policies from
`pipeserve.config.POLICIES` (what the router accepts), devices and placement modes from `pod.py`.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from pipeserve.care.restarts import GroupPhase
from pipeserve.config import POLICIES
from pipeserve_operator import corev1
from pipeserve_operator.owned import (
    OWNED_ANNOTATIONS,
    OWNED_ENV,
    OWNED_LABEL_PREFIX,
    OWNED_LABELS,
    OWNED_MOUNT_PATHS,
    OWNED_VOLUMES,
    RESERVED_FLAGS,
    cel_list,
)
from pipeserve_operator.pod import COLOCATE, DEVICES, GANGS

GROUP, VERSION, PLURAL, KIND = "pipeserve.io", "v1alpha1", "inferencepipelines", "InferencePipeline"

_STR = {"type": "string"}
_INT = {"type": "integer"}
_ANY_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, **extra}
    if required:
        out["required"] = required
    return out


def _spec_schema() -> dict[str, Any]:
    model = _obj(
        {
            "path": {**_STR, "minLength": 1, "description": "checkpoint directory inside the container"},
            "persistentVolumeClaim": {**_STR, "description": "a PVC mounted read-only at mountPath"},
            "hostPath": {**_STR, "description": "a node directory mounted read-only at mountPath"},
            "mountPath": {**_STR, "default": "/models"},
            "servedModelName": _STR,
        },
        ["path"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.persistentVolumeClaim) && has(self.hostPath))",
                    "message": "model.persistentVolumeClaim and model.hostPath are mutually exclusive",
                }
            ]
        },
    )
    hicache = _obj(
        {
            "url": {**_STR, "description": "redis:// or rediss:// URL of the L3 tier"},
            "secretRef": _obj({"name": _STR, "key": {**_STR, "default": "url"}}, ["name"]),
            "hostCacheGB": {"type": "number", "minimum": 0},
        },
        None,
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.url) && has(self.secretRef))",
                    "message": "hicache.url and hicache.secretRef are mutually exclusive",
                }
            ]
        },
    )
    resources = _obj({"requests": _ANY_OBJECT, "limits": _ANY_OBJECT})
    return _obj(
        {
            "model": model,
            "stages": {**_INT, "minimum": 1, "maximum": 64, "default": 1},
            "replicas": {**_INT, "minimum": 0, "default": 1},
            "image": {**_STR, "minLength": 1},
            "imagePullPolicy": {
                **_STR,
                "enum": ["Always", "IfNotPresent", "Never"],
                "default": "IfNotPresent",
            },
            "resources": resources,
            "layerSplit": {"type": "array", "items": {**_INT, "minimum": 1}, "maxItems": 64},
            "engine": {
                "type": "object",
                "description": "engine flags without leading dashes: a value, or true for a bare flag",
                "additionalProperties": {"x-kubernetes-preserve-unknown-fields": True},
                "maxProperties": corev1.MAX_ITEMS,
            },
            "device": {
                **_STR,
                "enum": list(DEVICES),
                "default": "auto",
                "description": "auto: cuda when resources ask for nvidia.com/gpu, else cpu",
            },
            "shmSizeLimit": {
                **corev1.QUANTITY,
                "default": "1Gi",
                "description": "size of the memory-backed /dev/shm of CUDA stage pods (NCCL)",
            },
            "hicache": hicache,
            "router": _obj(
                {
                    "policy": {
                        **_STR,
                        "enum": list(POLICIES),  # the router's own list (pipeserve.config)
                        "default": "round_robin",
                    }
                },
                default={},
            ),
            "wedgeTimeoutSeconds": {**_INT, "minimum": 1, "default": 60},
            "startupDeadlineSeconds": {**_INT, "minimum": 1, "default": 900},
            "restartBackoffSeconds": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "default": 5},
            "restartBackoffMaxSeconds": {
                "type": "number",
                "minimum": 0,
                "exclusiveMinimum": True,
                "default": 300,
            },
            "nodeSelector": {"type": "object", "additionalProperties": _STR},
            "tolerations": corev1.array(corev1.toleration()),
            "affinity": corev1.affinity(),
            "env": corev1.array(corev1.env_var()),
            "nccl": _obj({"socketIfname": _STR, "debug": _STR}),
            **_pod_fields(),
        },
        ["model", "image"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.layerSplit) || size(self.layerSplit) == self.stages",
                    "message": "layerSplit must have one entry per stage",
                },
                {
                    "rule": "self.restartBackoffMaxSeconds >= self.restartBackoffSeconds",
                    "message": "restartBackoffMaxSeconds must be >= restartBackoffSeconds",
                },
                *_owned_name_rules(),
            ]
        },
    )


def _pod_fields() -> dict[str, Any]:
    """What the spec passes into every stage pod, and where the pods go (placement, rollout)."""
    kueue_queue = {
        "rule": "self.gang != 'kueue' || has(self.queueName)",
        "message": "placement.queueName is required when placement.gang is kueue",
    }
    placement = _obj(
        {
            "colocate": {**_STR, "enum": list(COLOCATE), "default": "preferred"},
            "topologyKey": {**_STR, "minLength": 1, "default": "kubernetes.io/hostname"},
            "gang": {**_STR, "enum": list(GANGS), "default": "none"},
            "queueName": {**_STR, "minLength": 1},
        },
        None,
        default={},
        **{"x-kubernetes-validations": [kueue_queue]},
    )
    return {
        "envFrom": corev1.array(corev1.env_from_source()),
        "volumes": corev1.array(corev1.volume()),
        "volumeMounts": corev1.array(corev1.volume_mount()),
        "podLabels": corev1.string_map(),
        "podAnnotations": corev1.string_map(),
        "imagePullSecrets": corev1.array(corev1.local_object_reference()),
        "serviceAccountName": _STR,
        "priorityClassName": _STR,
        "runtimeClassName": _STR,
        "schedulerName": _STR,
        "topologySpreadConstraints": corev1.array(corev1.topology_spread_constraint()),
        "placement": placement,
        "rollout": _obj({"maxSurge": {**_INT, "minimum": 0, "maximum": 1}}),
    }


def _owned_name_rules() -> list[dict[str, str]]:
    """CEL: a name the operator sets on the stage pod is refused at admission (see owned.py)."""
    label_keys = f"!k.startsWith('{OWNED_LABEL_PREFIX}') && !(k in {cel_list(OWNED_LABELS)})"
    annotation_keys = f"!k.startsWith('{OWNED_LABEL_PREFIX}') && !(k in {cel_list(OWNED_ANNOTATIONS)})"
    model_mounted = "(has(self.model.persistentVolumeClaim) || has(self.model.hostPath))"
    return [
        {
            "rule": f"!has(self.engine) || self.engine.all(f, !(f in {cel_list(RESERVED_FLAGS)}))",
            "message": "engine: a flag the operator sets from the spec's own fields (see docs/kubernetes.md)",
        },
        {
            "rule": f"!has(self.env) || self.env.all(e, !(e.name in {cel_list(OWNED_ENV)}))",
            "message": f"env: a name the operator sets is refused: {', '.join(OWNED_ENV)}",
        },
        {
            "rule": f"!has(self.volumes) || self.volumes.all(v, !(v.name in {cel_list(OWNED_VOLUMES)}))",
            "message": f"volumes: a name the operator uses is refused: {', '.join(OWNED_VOLUMES)}",
        },
        {
            "rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, "
            f"!(m.mountPath in {cel_list(OWNED_MOUNT_PATHS)}) && !(m.name in {cel_list(OWNED_VOLUMES)}) "
            f"&& !({model_mounted} && m.mountPath == self.model.mountPath))",
            "message": "volumeMounts: the operator's volumes and mount paths (/tmp, /dev/shm, the model's) "
            "are refused",
        },
        {
            "rule": f"!has(self.podLabels) || self.podLabels.all(k, {label_keys})",
            "message": f"podLabels: keys under {OWNED_LABEL_PREFIX} and the operator's labels are refused",
        },
        {
            "rule": f"!has(self.podAnnotations) || self.podAnnotations.all(k, {annotation_keys})",
            "message": f"podAnnotations: keys under {OWNED_LABEL_PREFIX} and gang schedulers' are refused",
        },
        {
            "rule": "!has(self.placement) || self.placement.gang != 'volcano' || !has(self.schedulerName) "
            "|| self.schedulerName == 'volcano'",
            "message": "schedulerName: placement.gang volcano schedules with volcano",
        },
    ]


def _status_schema() -> dict[str, Any]:
    group = _obj(
        {
            "index": _INT,
            "phase": {**_STR, "enum": [p.value for p in GroupPhase]},  # what the restart policy decides
            "generation": _INT,
            "restarts": _INT,
            "ready": {"type": "boolean"},
            "endpoint": _STR,
            "lastFailure": _STR,
            "since": {**_STR, "format": "date-time"},
            # The restart decision's record (backoff, failures in a row): kept here so that an operator
            # restart loses no backoff. Not part of the public status contract.
            "record": _ANY_OBJECT,
        },
        ["index", "phase"],
    )
    condition = _obj(
        {
            "type": {**_STR, "enum": ["Ready", "Progressing", "Degraded"]},
            "status": {**_STR, "enum": ["True", "False", "Unknown"]},
            "reason": _STR,
            "message": _STR,
            "lastTransitionTime": {**_STR, "format": "date-time"},
            "observedGeneration": _INT,
        },
        ["type", "status"],
    )
    return _obj(
        {
            "observedGeneration": _INT,
            "replicas": _INT,
            "updatedReplicas": _INT,
            "readyReplicas": _INT,
            "restarts": _INT,
            "forcedDeletions": _INT,
            "lastFailure": _STR,
            "selector": _STR,
            "groups": {"type": "array", "items": group},
            "conditions": {"type": "array", "items": condition},
        }
    )


def _column(name: str, type_: str, path: str) -> dict[str, str]:
    return {"name": name, "type": type_, "jsonPath": path}


def crd_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": "inferencepipeline",
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": ["ip"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": _obj(
                            {
                                "apiVersion": _STR,
                                "kind": _STR,
                                "metadata": {"type": "object"},
                                "spec": _spec_schema(),
                                "status": _status_schema(),
                            },
                            ["spec"],
                        )
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        _column("Stages", "integer", ".spec.stages"),
                        _column("Replicas", "integer", ".spec.replicas"),
                        _column("Ready", "integer", ".status.readyReplicas"),
                        _column("Restarts", "integer", ".status.restarts"),
                        _column("Age", "date", ".metadata.creationTimestamp"),
                    ],
                }
            ],
        },
    }


def spec_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _apply_defaults(value[name], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply_defaults(v, schema["items"]) for v in value]
    return value


def with_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """A copy of `spec` with the schema's defaults filled in (the input is not modified)."""
    return _apply_defaults(copy.deepcopy(dict(spec)), spec_schema())


def main() -> None:
    import yaml

    sys.stdout.write(yaml.safe_dump(crd_manifest(), sort_keys=False))


if __name__ == "__main__":
    main()
