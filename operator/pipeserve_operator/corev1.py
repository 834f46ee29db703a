"""Structural OpenAPI schemas of the core/v1 types the InferencePipeline passes into its stage pods.

Written out field by field after Kubernetes' own OpenAPI (core/v1, 1.35), because the API server
prunes every field a CRD schema does not declare: an `env` item declared as {name, value} loses its
`valueFrom` (and the Secret it names) without an error. The types too large to restate by hand
(Volume with its every source, Toleration, Affinity) are generated from the same definitions into
`corev1_types.json` (tests/k8s/corev1_gen.py): a misspelt or mistyped field of theirs is refused at
admission (or pruned, never reaching a StatefulSet) instead of failing the operator's write later.
tests/k8s/test_crd.py checks all of them against the 1.35 definitions. Names and paths carry a
maxLength so that the CEL rules over them have a bounded cost (the API server refuses a CRD whose
rules it cannot bound).
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from typing import Any

STR: dict[str, Any] = {"type": "string"}
NAME: dict[str, Any] = {"type": "string", "maxLength": 253}
BOOL: dict[str, Any] = {"type": "boolean"}
INT: dict[str, Any] = {"type": "integer"}
QUANTITY: dict[str, Any] = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}
MAX_ITEMS = 128  # pod-level lists: far above real use, and a bound the CEL cost estimator needs


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, **extra}
    if required:
        out["required"] = required
    return out


def array(items: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, "maxItems": MAX_ITEMS, **extra}


def string_map(max_properties: int = MAX_ITEMS) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": STR, "maxProperties": max_properties}


def _key_ref(*required: str, **props: dict[str, Any]) -> dict[str, Any]:
    return obj({**props, "optional": BOOL}, list(required))


def env_var() -> dict[str, Any]:
    value_from = obj(
        {
            "configMapKeyRef": _key_ref("key", key=STR, name=STR),
            "secretKeyRef": _key_ref("key", key=STR, name=STR),
            "fieldRef": obj({"apiVersion": STR, "fieldPath": STR}, ["fieldPath"]),
            "resourceFieldRef": obj(
                {"containerName": STR, "divisor": QUANTITY, "resource": STR}, ["resource"]
            ),
            "fileKeyRef": _key_ref("key", "path", "volumeName", key=STR, path=STR, volumeName=STR),
        }
    )
    return obj({"name": {**NAME, "minLength": 1}, "value": STR, "valueFrom": value_from}, ["name"])


def env_from_source() -> dict[str, Any]:
    ref = obj({"name": STR, "optional": BOOL})
    return obj({"prefix": STR, "configMapRef": ref, "secretRef": ref})


@functools.cache
def _generated() -> dict[str, Any]:
    return dict(json.loads((resources.files("pipeserve_operator") / "corev1_types.json").read_text()))


def generated(name: str) -> dict[str, Any]:
    """The structural schema of core/v1 `name` (Volume, Toleration, Affinity), a fresh copy."""
    return copy.deepcopy(_generated()[name])


def volume() -> dict[str, Any]:
    out = generated("Volume")
    out["properties"]["name"] = {**NAME, "minLength": 1}  # the CEL rule over volume names: bounded
    return out


def toleration() -> dict[str, Any]:
    return generated("Toleration")


def affinity() -> dict[str, Any]:
    return generated("Affinity")


def volume_mount() -> dict[str, Any]:
    return obj(
        {
            "name": {**NAME, "minLength": 1},
            "mountPath": {**STR, "minLength": 1, "maxLength": 4096},
            "readOnly": BOOL,
            "recursiveReadOnly": STR,
            "subPath": STR,
            "subPathExpr": STR,
            "mountPropagation": STR,
        },
        ["name", "mountPath"],
    )


def local_object_reference() -> dict[str, Any]:
    return obj({"name": STR})


def label_selector() -> dict[str, Any]:
    requirement = obj(
        {"key": STR, "operator": STR, "values": {"type": "array", "items": STR}}, ["key", "operator"]
    )
    return obj(
        {
            "matchLabels": {"type": "object", "additionalProperties": STR},
            "matchExpressions": array(requirement),
        }
    )


def topology_spread_constraint() -> dict[str, Any]:
    return obj(
        {
            "maxSkew": INT,
            "topologyKey": STR,
            "whenUnsatisfiable": STR,
            "labelSelector": label_selector(),
            "minDomains": INT,
            "nodeAffinityPolicy": STR,
            "nodeTaintsPolicy": STR,
            "matchLabelKeys": {"type": "array", "items": STR},
        },
        ["maxSkew", "topologyKey", "whenUnsatisfiable"],
    )
