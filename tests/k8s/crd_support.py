"""What the API server does with an InferencePipeline before the operator sees it, done here.

* `prune(value, schema)`: structural-schema pruning — a field the schema does not declare is dropped
  silently unless `x-kubernetes-preserve-unknown-fields` keeps it (how an undeclared `valueFrom` lost
  its Secret).
* `cel_rules(schema)`: every `x-kubernetes-validations` rule with the path of the node it sits on.
* `evaluate(rule, value, schema)`: the rule run by cel-python with `self` typed after the schema, as
  the API server types it (`number` is a double even when written 5, `integer` an int).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
from celpy import celtypes

from pipeserve_operator import spec as spec_model
from pipeserve_operator.crd import crd_manifest, spec_schema, with_defaults
from pipeserve_operator.resources import stage_statefulset


def cr_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def prune(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields", False) or extra is True
        out = {}
        for key, sub in value.items():
            if key in props:
                out[key] = prune(sub, props[key])
            elif isinstance(extra, dict):
                out[key] = prune(sub, extra)
            elif keep_unknown:
                out[key] = copy.deepcopy(sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(v, schema["items"]) for v in value]
    return copy.deepcopy(value)


def admitted(cr: dict[str, Any]) -> dict[str, Any]:
    """The CR as the API server stores it: spec pruned then defaulted (metadata kept as is)."""
    out = copy.deepcopy(cr)
    out["spec"] = with_defaults(prune(cr["spec"], spec_schema()))
    return out


def cel_rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for name, sub in (schema.get("properties") or {}).items():
        yield from cel_rules(sub, (*path, name))
    if isinstance(schema.get("items"), dict):
        yield from cel_rules(schema["items"], (*path, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from cel_rules(schema["additionalProperties"], (*path, "{}"))


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if isinstance(value, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        return celtypes.MapType(
            {
                celtypes.StringType(k): to_cel(v, props.get(k) or (extra if isinstance(extra, dict) else {}))
                for k, v in value.items()
            }
        )
    if isinstance(value, list):
        return celtypes.ListType([to_cel(v, schema.get("items") or {}) for v in value])
    if kind == "number":
        return celtypes.DoubleType(float(value))
    if kind == "integer":
        return celtypes.IntType(value)
    return celpy.json_to_cel(value)


def node(value: Any, path: tuple[str, ...]) -> Any:
    """The value at `path` (keys only: rules under list items are evaluated per item by the caller)."""
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def schema_at(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        schema = schema["properties"][key]
    return schema


def evaluate(rule: str, value: Any, schema: dict[str, Any]) -> bool:
    env = celpy.Environment()
    result = env.program(env.compile(rule)).evaluate({"self": to_cel(value, schema)})
    if isinstance(result, Exception):
        raise result
    return bool(result)


def render(cr: dict[str, Any], index: int, generation: int) -> dict[str, Any]:
    """Group `index`'s StatefulSet as the operator renders it: the spec defaulted and parsed once into
    the typed model (spec.parse), the CR itself read for its metadata only."""
    return stage_statefulset(cr, spec_model.parse(with_defaults(cr["spec"])), index, generation)
