"""Generate operator/pipeserve_operator/corev1_types.json: the structural schemas of the core/v1 types
the InferencePipeline passes into its pods whole (Volume, Toleration, Affinity), from Kubernetes' own
OpenAPI definitions (1.35, as kubernetes-validate ships them):

    .venv/bin/python tests/k8s/corev1_gen.py > operator/pipeserve_operator/corev1_types.json

What a CRD's structural schema takes from a definition: every property (the API server prunes an
undeclared one, or refuses it under kubectl's strict field validation), its type without `null`,
`required`, `format`, items and maps. Descriptions are dropped (the CRD stays small; `kubectl explain`
of the built-in type has them). Quantity and IntOrString become int-or-string; a type with no
properties of its own (FieldsV1) an object that keeps unknown fields; a Quantity also carries
the pattern of `corev1.QUANTITY`. tests/k8s/test_crd.py checks
the file is this script's output and that the CRD declares every field of each type.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate

from pipeserve_operator.corev1 import QUANTITY

K8S = "1.35"
TYPES = ("Volume", "Toleration", "Affinity")
INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}


def definitions() -> dict[str, Any]:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{K8S}.0-local"
    return json.loads((root / "_definitions.json").read_text())["$defs"]


def _type(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        return kinds[0] if len(kinds) == 1 else None
    return kind


def convert(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[-1]
        if name.endswith(".Quantity"):
            return dict(QUANTITY)  # the API server parses a quantity: so does the schema's pattern
        if name.endswith(".IntOrString"):
            return dict(INT_OR_STRING)
        return convert(defs[name], defs)
    if "oneOf" in schema or "anyOf" in schema:
        return dict(INT_OR_STRING)
    kind = _type(schema)
    out: dict[str, Any] = {}
    if kind is not None:
        out["type"] = kind
    if "format" in schema and kind in ("integer", "number", "string"):
        out["format"] = schema["format"]
    if "properties" in schema:
        out["type"] = "object"
        out["properties"] = {k: convert(v, defs) for k, v in sorted(schema["properties"].items())}
        if schema.get("required"):
            out["required"] = sorted(schema["required"])
    elif kind == "object" or kind is None:
        extra = schema.get("additionalProperties")
        out["type"] = "object"
        if isinstance(extra, dict):
            out["additionalProperties"] = convert(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = convert(schema["items"], defs)
    return out


def generate() -> dict[str, Any]:
    defs = definitions()
    return {name: convert(defs[f"io.k8s.api.core.v1.{name}"], defs) for name in TYPES}


def render() -> str:
    return json.dumps(generate(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
