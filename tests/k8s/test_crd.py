"""The InferencePipeline CRD: a valid apiextensions.k8s.io/v1 object (Kubernetes 1.35 schemas, strict),
examples checked against its own openAPIV3Schema, `with_defaults` filling the schema's defaults, the
builders' output valid against the core schemas, and engine flags checked against the stage's parser.
CEL rules are checked by the API server only: the same rules are re-checked here by the builders."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from crd_support import prune, render

from pipeserve_operator import corev1
from pipeserve_operator.crd import crd_manifest, spec_schema, with_defaults
from pipeserve_operator.resources import SpecError, engine_args, stage_service

K8S = "1.35"
EXAMPLE = {
    "apiVersion": "pipeserve.io/v1alpha1",
    "kind": "InferencePipeline",
    "metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"},
    "spec": {
        "model": {"path": "/models/demo", "persistentVolumeClaim": "weights"},
        "image": "pipeserve/stage:0.1.0",
        "stages": 2,
        "replicas": 2,
        "resources": {"limits": {"nvidia.com/gpu": 1}, "requests": {"cpu": "2", "memory": "8Gi"}},
        "layerSplit": [3, 5],
        "engine": {"max-num-seqs": 16, "dtype": "float32", "enable-prefix-caching": True},
        "hicache": {"url": "redis://redis:6379/0", "hostCacheGB": 4},
        "router": {"policy": "prefix_affinity"},
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "env": [{"name": "PIPESERVE_LOG_LEVEL", "value": "DEBUG"}],
        "nccl": {"socketIfname": "eth0", "debug": "WARN"},
    },
}


def schema_validator() -> jsonschema.Draft4Validator:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(schema)  # OpenAPI v3.0: boolean exclusiveMinimum


def test_crd_is_a_valid_kubernetes_object() -> None:
    kubernetes_validate.validate(crd_manifest(), K8S, strict=True)
    version = crd_manifest()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Stages",
        "Replicas",
        "Ready",
        "Updated",
        "Restarts",
        "Age",
    ]


def test_example_validates_and_builds_valid_objects() -> None:
    schema_validator().validate(EXAMPLE)
    kubernetes_validate.validate(render(EXAMPLE, 1, 3), K8S, strict=True)
    kubernetes_validate.validate(stage_service(EXAMPLE, 1), K8S, strict=True)


@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "stages"), 0),
        (("spec", "stages"), 65),
        (("spec", "replicas"), -1),
        (("spec", "imagePullPolicy"), "Sometimes"),
        (("spec", "router", "policy"), "random"),
        (("spec", "restartBackoffSeconds"), 0),
        (("spec", "layerSplit"), [0, 8]),
        (("spec", "model", "path"), ""),
        (("spec", "env"), [{"value": "no name"}]),
        (("spec", "image"), None),
    ],
)
def test_invalid_specs_are_rejected(path: tuple[str, ...], value: object) -> None:
    bad = copy.deepcopy(EXAMPLE)
    target = bad
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        schema_validator().validate(bad)


def test_rules_the_schema_cannot_say_are_cel_and_builder_checks() -> None:
    rules = str(crd_manifest())
    for rule in (
        "size(self.layerSplit) == self.stages",
        "has(self.persistentVolumeClaim) && has(self.hostPath)",
    ):
        assert rule in rules
    bad = copy.deepcopy(EXAMPLE)
    bad["spec"]["layerSplit"] = [8]
    with pytest.raises(SpecError, match="layerSplit"):
        render(bad, 0, 1)
    bad = copy.deepcopy(EXAMPLE)
    bad["spec"]["model"]["hostPath"] = "/data"
    with pytest.raises(SpecError, match="mutually exclusive"):
        render(bad, 0, 1)


def test_with_defaults_fills_the_schema_defaults() -> None:
    spec = with_defaults({"model": {"path": "/m"}, "image": "i", "hicache": {"secretRef": {"name": "s"}}})
    assert spec["stages"] == 1 and spec["replicas"] == 1 and spec["imagePullPolicy"] == "IfNotPresent"
    assert spec["model"]["mountPath"] == "/models" and spec["router"] == {"policy": "round_robin"}
    assert spec["hicache"]["secretRef"]["key"] == "url"
    assert (spec["wedgeTimeoutSeconds"], spec["startupDeadlineSeconds"]) == (60, 900)
    assert spec["restartBackoffSeconds"] == spec_schema()["properties"]["restartBackoffSeconds"]["default"]
    assert with_defaults({"stages": 4, "model": {"path": "/m", "mountPath": "/w"}})["stages"] == 4


@pytest.mark.parametrize(
    "engine, error",
    [
        ({"no-such-flag": 1}, "not a `pipeserve stage` flag"),
        ({"world-size": 4}, "set by the operator"),
        ({"max-num-seqs": True}, "takes a value"),
        ({"enable-prefix-caching": "yes"}, "not a valid value"),
    ],
)
def test_engine_flags_are_checked_against_the_stage_parser(engine: dict, error: str) -> None:
    with pytest.raises(SpecError, match=error):
        engine_args(engine)


def test_engine_flags_map_to_arguments() -> None:
    args = engine_args({"max-num-seqs": 16, "dtype": "float32", "enable-prefix-caching": False})
    assert args == ["--max-num-seqs", "16", "--dtype", "float32", "--no-enable-prefix-caching"]


def _definitions() -> dict:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{K8S}.0-local"
    return json.loads((root / "_definitions.json").read_text())["$defs"]


def _types(schema: dict) -> set[str]:
    kind = schema.get("type", [])
    return {kind} if isinstance(kind, str) else set(kind) - {"null"}


def _covers(mine: dict, ref: str, defs: dict, path: str) -> int:
    """Every field of the 1.35 definition `ref` is declared in `mine`, with its type and required list,
    recursively; returns how many fields were compared."""
    theirs = defs[ref.rsplit("/", 1)[-1]]
    if "properties" not in theirs:  # a scalar (Time: a string) or an open type (FieldsV1): kept whole
        if _types(theirs) - {"object"}:
            assert _types(mine) == _types(theirs), path
        else:
            assert mine.get("x-kubernetes-preserve-unknown-fields") is True, path
        return 1
    assert set(mine.get("required", [])) == set(theirs.get("required", [])), path
    compared = 0
    for name, sub in theirs["properties"].items():
        assert name in mine["properties"], f"{path}.{name} is not declared: the API server would prune it"
        own = mine["properties"][name]
        extra = sub.get("additionalProperties")
        target = sub.get("$ref") or (sub.get("items") or {}).get("$ref")
        if isinstance(extra, dict) and extra.get("$ref", "").endswith(("Quantity", "IntOrString")):
            assert own["additionalProperties"].get("x-kubernetes-int-or-string") is True, f"{path}.{name}"
        elif isinstance(extra, dict) and "$ref" in extra:
            compared += _covers(own["additionalProperties"], extra["$ref"], defs, f"{path}.{name}")
        elif target and target.endswith(("Quantity", "IntOrString")):
            assert own.get("x-kubernetes-int-or-string") is True, f"{path}.{name}"
        elif target:
            compared += _covers(own["items"] if "items" in sub else own, target, defs, f"{path}.{name}")
        else:
            assert _types(own) == _types(sub), f"{path}.{name}: {own} vs {sub}"
        compared += 1
    return compared


@pytest.mark.parametrize(
    "field, definition",
    [
        ("env", "EnvVar"),
        ("envFrom", "EnvFromSource"),
        ("volumeMounts", "VolumeMount"),
        ("imagePullSecrets", "LocalObjectReference"),
        ("topologySpreadConstraints", "TopologySpreadConstraint"),
        ("volumes", "Volume"),
        ("tolerations", "Toleration"),
        ("affinity", "Affinity"),
    ],
)
def test_pod_fields_declare_the_whole_core_v1_type(field: str, definition: str) -> None:
    """The API server prunes what the schema does not declare: each list's items (affinity: the object)
    declare every field of the Kubernetes type they stand for (env's valueFrom, and every source of it,
    every volume source, included), and nothing keeps unknown fields but FieldsV1."""
    mine = spec_schema()["properties"][field]
    node = mine["items"] if mine["type"] == "array" else mine
    assert "x-kubernetes-preserve-unknown-fields" not in node
    assert _covers(node, f"io.k8s.api.core.v1.{definition}", _definitions(), field) >= 1


def test_the_generated_core_v1_types_are_the_generators_output() -> None:
    from corev1_gen import render

    path = Path(corev1.__file__).parent / "corev1_types.json"
    assert path.read_text() == render(), "regenerate: python tests/k8s/corev1_gen.py > " + str(path)


@pytest.mark.parametrize(
    "field, value",
    [
        ("tolerations", [{"key": "gpu", "operator": "Exists", "tolerationSeconds": "soon"}]),
        ("tolerations", [{"key": "gpu", "operater": "Exists"}]),
        ("affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}),
        (
            "affinity",
            {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}},
        ),
        ("affinity", {"nodeAfinity": {}}),
        ("volumes", [{"name": "w", "hostPath": {"type": "Directory"}}]),
        ("volumes", [{"name": "w", "emptyDir": {"sizeLimit": "lots"}}]),
        ("volumes", [{"name": "w", "nsf": {"server": "nfs", "path": "/w"}}]),
        ("volumes", [{"name": "w", "configMap": {"name": "c", "defaultMode": "0644"}}]),
    ],
)
def test_a_bad_pod_field_is_refused_at_admission(field: str, value: object) -> None:
    """A wrong type or a missing required field fails the schema; a misspelt field is unknown to it,
    which kubectl's strict field validation (its default) refuses, and which the API server would
    otherwise prune: either way it never reaches a StatefulSet."""
    bad = copy.deepcopy(EXAMPLE)
    bad["spec"][field] = value
    errors = list(schema_validator().iter_errors(bad))
    unknown = prune(bad["spec"], spec_schema()) != bad["spec"]
    assert errors or unknown, (field, value)
    good = copy.deepcopy(EXAMPLE)
    good["spec"].update(
        tolerations=[{"key": "gpu", "operator": "Exists", "tolerationSeconds": 30}],
        affinity={
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
        },
        volumes=[{"name": "w", "nfs": {"server": "nfs", "path": "/w"}, "configMap": None}],
    )
    del good["spec"]["volumes"][0]["configMap"]
    schema_validator().validate(good)
    assert prune(good["spec"], spec_schema()) == good["spec"]


def test_pod_and_placement_defaults() -> None:
    spec = with_defaults({"model": {"path": "/m"}, "image": "i"})
    assert spec["device"] == "auto" and spec["shmSizeLimit"] == "1Gi"
    assert spec["placement"] == {
        "colocate": "preferred",
        "topologyKey": "kubernetes.io/hostname",
        "gang": "none",
    }
    assert "rollout" not in spec
    rollout = spec_schema()["properties"]["rollout"]["properties"]["maxSurge"]
    assert (rollout["type"], rollout["minimum"], rollout["maximum"]) == ("integer", 0, 1)
    for bad in (
        {"device": "tpu"},
        {"rollout": {"maxSurge": 2}},
        {"placement": {"gang": "slurm"}},
        {"shmSizeLimit": "lots"},
    ):
        body = copy.deepcopy(EXAMPLE)
        body["spec"].update(bad)
        with pytest.raises(jsonschema.ValidationError):
            schema_validator().validate(body)


def test_enums_are_their_one_definitions() -> None:
    """The CRD offers exactly what the code handles: every group phase the restart policy decides, every
    router policy the router accepts, every device and placement mode the builders render."""
    from pipeserve.care.restarts import GroupPhase
    from pipeserve.config import POLICIES
    from pipeserve_operator.pod import COLOCATE, DEVICES, GANGS

    root = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    group = root["status"]["properties"]["groups"]["items"]["properties"]
    assert group["phase"]["enum"] == [p.value for p in GroupPhase]
    spec = spec_schema()["properties"]
    assert spec["router"]["properties"]["policy"]["enum"] == list(POLICIES)
    assert spec["device"]["enum"] == list(DEVICES)
    placement = spec["placement"]["properties"]
    assert placement["gang"]["enum"] == list(GANGS) and placement["colocate"]["enum"] == list(COLOCATE)
    for extra in (
        *({"device": d} for d in DEVICES),
        *({"placement": {"gang": g, "queueName": "q"}} for g in GANGS),
        *({"placement": {"colocate": c}} for c in COLOCATE),
    ):
        body = copy.deepcopy(EXAMPLE)
        body["spec"].update(extra)
        schema_validator().validate(body)
        render(body, 0, 1)
