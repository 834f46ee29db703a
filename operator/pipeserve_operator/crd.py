"""The InferencePipeline CustomResourceDefinition: the one source of truth for its schema.

    python -m pipeserve_operator.crd > charts/pipeserve/crds/inferencepipeline.yaml

`crd_manifest()` is the whole CRD (apiextensions.k8s.io/v1). The spec's schema is generated from the typed
model in spec.py (its fields, defaults, bounds, enums and per-field CEL rules); the status's is here.
Defaults live only in the OpenAPI schema;
`with_defaults(spec)` applies them the way the API server does (walking the schema: a default fills a
missing field, then that field's own properties are defaulted in turn), so the operator and the chart's
tests never restate a default. What the schema cannot say (a list's length against another field, two
mutually exclusive fields) is a CEL rule (`x-kubernetes-validations`), checked by the API server.
`exclusiveMinimum` is OpenAPI v3.0's boolean form: validate examples with a Draft 4 validator. Enums
come from their one definition: group phases from `care.restarts.GroupPhase`, router policies from
`pipeserve.config.POLICIES` (what the router accepts), devices and placement modes from `spec.py`.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

from pipeserve.care.restarts import GroupPhase
from pipeserve_operator import spec as spec_model
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
    """The typed model's schema (spec.py: fields, defaults, bounds, enums, the per-field CEL rules), with
    the rules that span fields (here: they need owned.py's lists)."""
    schema = spec_model.openapi_schema()
    schema["x-kubernetes-validations"] = [
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
    return schema


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
            # Canary rollouts (canary.py): the hashes of the resource's spec and of the spec every group
            # ran last, and that spec itself (JSON text: a merge patch replaces a string whole).
            "updateRevision": _STR,
            "currentRevision": _STR,
            "currentSpec": _STR,
            "conditions": {"type": "array", "items": condition},
        }
    )


def _column(name: str, type_: str, path: str) -> dict[str, str]:
    return {"name": name, "type": type_, "jsonPath": path}


def crd_manifest() -> dict[str, Any]:
    return copy.deepcopy(_manifest())


@functools.cache
def _manifest() -> dict[str, Any]:
    # Built once: generating the schema from the typed model walks it whole (~0.3 s), and every
    # reconcile reads it (with_defaults). Callers get a copy, spec_schema a read-only view.
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
                        _column("Updated", "integer", ".status.updatedReplicas"),
                        _column("Restarts", "integer", ".status.restarts"),
                        _column("Age", "date", ".metadata.creationTimestamp"),
                    ],
                }
            ],
        },
    }


def spec_schema() -> dict[str, Any]:
    """The spec's schema, shared: read it, do not modify it."""
    return _manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


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
