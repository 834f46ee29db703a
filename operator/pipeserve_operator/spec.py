"""The InferencePipeline spec as one typed model (msgspec): the CRD's schema is generated from it.

    openapi_schema() -> the spec's openAPIV3Schema (crd.py puts it in the CRD)
    parse(spec)      -> PipelineSpec: the defaulted spec, typed (the operator parses a CR once a tick)
    shape(spec)      -> Shape(replicas, stages, partition): of a defaulted spec even one parse refuses

Each field's type, default, bounds (`Meta(ge/le/min_length/max_items/...)`), enum (from its one
definition: here, pipeserve.config.POLICIES) and CEL rules (`x-kubernetes-validations`, through
`Meta(extra_json_schema=...)`; the spec-wide ones in crd.py, which need owned.py's lists) live here.
The pass-through core/v1 fields (volumes, tolerations, affinity, env, ...) stay JSON objects typed by
their core/v1 schemas (corev1.py): the operator copies them into the pod as given.

`openapi_schema` turns msgspec's JSON Schema (draft 2020-12) into the structural OpenAPI v3.0 schema a
CRD takes: references inlined (a CRD has no $ref), `X | None` as X (absent = null), no titles, an
empty `required` dropped, `exclusiveMinimum: n` as OpenAPI 3.0's `minimum: n, exclusiveMinimum: true`.
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

import msgspec
from msgspec import Meta, field

from pipeserve.config import POLICIES
from pipeserve_operator import corev1

# A group index bound: a StatefulSet's partition is an int32; a partition >= replicas holds every group.
MAX_PARTITION = 10_000
MAX_STAGES = 64
# The spec's choices (the CRD's enums are these; pod.py renders each): spec.device, placement.colocate,
# placement.gang.
DEVICES = ("auto", "cpu", "cuda")
COLOCATE = ("preferred", "required", "none")
GANGS = ("none", "volcano", "kueue")


def _enum(values: tuple[str, ...] | list[str], **extra: Any) -> Meta:
    return Meta(extra_json_schema={"enum": list(values), **extra})


def _x(**schema: Any) -> Meta:
    """Schema keys msgspec has no Meta for (core/v1 shapes, preserve-unknown, CEL rules, defaults)."""
    return Meta(extra_json_schema=schema)


def _rules(*pairs: tuple[str, str]) -> Meta:
    return _x(**{"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in pairs]})


class Model(msgspec.Struct, omit_defaults=True):
    path: Annotated[str, Meta(min_length=1, description="checkpoint directory inside the container")]
    persistentVolumeClaim: Annotated[str, Meta(description="a PVC mounted read-only at mountPath")] | None = (
        None
    )
    hostPath: Annotated[str, Meta(description="a node directory mounted read-only at mountPath")] | None = (
        None
    )
    mountPath: str = "/models"
    servedModelName: str | None = None


class SecretRef(msgspec.Struct, omit_defaults=True):
    name: str
    key: str = "url"


class HiCache(msgspec.Struct, omit_defaults=True):
    url: Annotated[str, Meta(description="redis:// or rediss:// URL of the L3 tier")] | None = None
    secretRef: SecretRef | None = None
    hostCacheGB: Annotated[float, Meta(ge=0)] | None = None


class Resources(msgspec.Struct, omit_defaults=True):
    requests: Annotated[dict[str, Any] | None, _x(**{"x-kubernetes-preserve-unknown-fields": True})] = None
    limits: Annotated[dict[str, Any] | None, _x(**{"x-kubernetes-preserve-unknown-fields": True})] = None


class Router(msgspec.Struct, omit_defaults=True):
    policy: Annotated[str, _enum(POLICIES)] = "round_robin"  # the router's own list (pipeserve.config)


class Nccl(msgspec.Struct, omit_defaults=True):
    socketIfname: str | None = None
    debug: str | None = None


class Placement(msgspec.Struct, omit_defaults=True):
    colocate: Annotated[str, _enum(COLOCATE)] = "preferred"
    topologyKey: Annotated[str, Meta(min_length=1)] = "kubernetes.io/hostname"
    gang: Annotated[str, _enum(GANGS)] = "none"
    queueName: Annotated[str, Meta(min_length=1)] | None = None


class Rollout(msgspec.Struct, omit_defaults=True):
    maxSurge: Annotated[int, Meta(ge=0, le=1)] | None = None
    partition: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=MAX_PARTITION,
                description="as a StatefulSet's: only groups with index >= partition take a new spec; "
                "the others keep the previous one (canary.py)",
            ),
        ]
        | None
    ) = None


_MODEL_RULES = _rules(
    (
        "!(has(self.persistentVolumeClaim) && has(self.hostPath))",
        "model.persistentVolumeClaim and model.hostPath are mutually exclusive",
    )
)
_HICACHE_RULES = _rules(
    ("!(has(self.url) && has(self.secretRef))", "hicache.url and hicache.secretRef are mutually exclusive")
)
_PLACEMENT_RULES = _rules(
    (
        "self.gang != 'kueue' || has(self.queueName)",
        "placement.queueName is required when placement.gang is kueue",
    )
)
_JSON = dict[str, Any]


class PipelineSpec(msgspec.Struct, omit_defaults=True):
    """What an InferencePipeline serves, and how (docs/kubernetes.md)."""

    model: Annotated[Model, _MODEL_RULES]
    image: Annotated[str, Meta(min_length=1)]
    stages: Annotated[int, Meta(ge=1, le=MAX_STAGES)] = 1
    replicas: Annotated[int, Meta(ge=0)] = 1
    imagePullPolicy: Annotated[str, _enum(["Always", "IfNotPresent", "Never"])] = "IfNotPresent"
    resources: Resources | None = None
    layerSplit: Annotated[list[Annotated[int, Meta(ge=1)]], Meta(max_length=MAX_STAGES)] | None = None
    engine: Annotated[
        dict[str, Any] | None,
        _x(
            description="engine flags without leading dashes: a value, or true for a bare flag",
            additionalProperties={"x-kubernetes-preserve-unknown-fields": True},
            maxProperties=corev1.MAX_ITEMS,
        ),
    ] = None
    device: Annotated[
        str, _enum(DEVICES, description="auto: cuda when resources ask for nvidia.com/gpu, else cpu")
    ] = "auto"
    shmSizeLimit: Annotated[
        Any,
        _x(**corev1.QUANTITY, description="size of the memory-backed /dev/shm of CUDA stage pods (NCCL)"),
    ] = "1Gi"
    hicache: Annotated[HiCache | None, _HICACHE_RULES] = None
    router: Annotated[Router, _x(default={})] = field(default_factory=Router)
    wedgeTimeoutSeconds: Annotated[int, Meta(ge=1)] = 60
    startupDeadlineSeconds: Annotated[int, Meta(ge=1)] = 900
    restartBackoffSeconds: Annotated[float, Meta(gt=0)] = 5.0
    restartBackoffMaxSeconds: Annotated[float, Meta(gt=0)] = 300.0
    nodeSelector: Annotated[dict[str, str] | None, _x(additionalProperties={"type": "string"})] = None
    tolerations: Annotated[list[_JSON] | None, _x(**corev1.array(corev1.toleration()))] = None
    affinity: Annotated[_JSON | None, _x(**corev1.affinity())] = None
    env: Annotated[list[_JSON] | None, _x(**corev1.array(corev1.env_var()))] = None
    nccl: Nccl | None = None
    envFrom: Annotated[list[_JSON] | None, _x(**corev1.array(corev1.env_from_source()))] = None
    volumes: Annotated[list[_JSON] | None, _x(**corev1.array(corev1.volume()))] = None
    volumeMounts: Annotated[list[_JSON] | None, _x(**corev1.array(corev1.volume_mount()))] = None
    podLabels: Annotated[dict[str, str] | None, _x(**corev1.string_map())] = None
    podAnnotations: Annotated[dict[str, str] | None, _x(**corev1.string_map())] = None
    imagePullSecrets: Annotated[list[_JSON] | None, _x(**corev1.array(corev1.local_object_reference()))] = (
        None
    )
    serviceAccountName: str | None = None
    priorityClassName: str | None = None
    runtimeClassName: str | None = None
    schedulerName: str | None = None
    topologySpreadConstraints: Annotated[
        list[_JSON] | None, _x(**corev1.array(corev1.topology_spread_constraint()))
    ] = None
    placement: Annotated[Placement, _PLACEMENT_RULES, _x(default={})] = field(default_factory=Placement)
    rollout: Rollout | None = None


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        ref = _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        node = {**ref, **{k: v for k, v in node.items() if k != "$ref"}}
    if any(b.get("type") == "null" for b in node.get("anyOf") or []):  # X | None: absent rather than null
        (branch,) = [b for b in node["anyOf"] if b.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf" and not (k == "default" and v is None)}
        node = {**_inline(branch, defs), **rest}
    out = {k: _inline(v, defs) for k, v in node.items() if k != "title"}
    if out.get("required") == []:
        del out["required"]
    if "exclusiveMinimum" in out and not isinstance(out["exclusiveMinimum"], bool):
        out["minimum"], out["exclusiveMinimum"] = out["exclusiveMinimum"], True  # OpenAPI v3.0's form
    if "properties" in out:  # CRD properties are a map, not a Python field list: keep the model's order
        out["properties"] = {k: _inline(v, defs) for k, v in node["properties"].items()}
    return out


def openapi_schema() -> dict[str, Any]:
    """The spec's structural schema (no CEL rules at the spec's own level: crd.py adds those)."""
    doc = msgspec.json.schema(PipelineSpec)
    out = _inline(doc, doc["$defs"])
    out.pop("$defs", None)
    out.pop("description", None)
    return out


def parse(spec: dict[str, Any]) -> PipelineSpec:
    """The CR's spec, typed, with the model's defaults (msgspec.ValidationError for a spec the schema
    refuses: one stored before a bound existed, or an API server that skipped the schema)."""
    return msgspec.convert(spec, PipelineSpec)


class Shape(NamedTuple):
    replicas: int
    stages: int
    partition: int


def shape(spec: dict[str, Any]) -> Shape:
    """How many groups of how many stages a defaulted spec asks for, and its rollout partition, read from
    the JSON: a spec the model refuses (InvalidSpec: nothing is rendered) still has its groups observed
    and counted in status. The only dict reads of spec fields outside this module and crd.py's schema
    walk (tests/k8s/test_spec_typed.py)."""
    rollout = spec.get("rollout") or {}
    return Shape(int(spec["replicas"]), int(spec["stages"]), int(rollout.get("partition") or 0))
