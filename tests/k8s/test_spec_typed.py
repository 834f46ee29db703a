"""The operator reads the InferencePipeline spec through its typed model (spec.py), never as a dict.

A dict lookup of a misspelt field (`spec.get("nodeSelecter")`) is a silent None; an attribute of the
msgspec model (`spec.nodeSelecter`) is a mypy error and an AttributeError. So:
* the builders take the typed model: rendered from a CR that carries only its metadata plus the model,
  a group's objects are those rendered from the whole CR (nothing reads the CR's spec behind the model);
* no module of the operator, except spec.py (the model, and `shape` for a spec the model refuses) and
  crd.py (the schema's defaults walk), looks a spec field up by its name in a dict (an AST scan), bar
  the few lookups listed below, each on an object that is not the pipeline's spec.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

from crd_support import admitted, render

from pipeserve_operator import pod
from pipeserve_operator import spec as spec_model
from pipeserve_operator.objects import pod_group
from pipeserve_operator.resources import stage_statefulset
from pipeserve_operator.spec import PipelineSpec

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "pipeserve_operator"
EXEMPT_MODULES = {"spec.py", "crd.py"}
# (module, the lookup as ast.unparse writes it): on an owned object's spec, not the pipeline's.
ALLOWED = {
    ("writes.py", "spec.pop('replicas', None)"),  # a StatefulSet's replicas (the supervisor's to set)
    ("writes.py", "live['spec']['replicas']"),  # the live StatefulSet's replicas, kept on a replace
}

CR = {
    "apiVersion": "pipeserve.io/v1alpha1",
    "kind": "InferencePipeline",
    "metadata": {"name": "p", "namespace": "ml", "uid": "u-1"},
    "spec": {
        "model": {"path": "/m", "hostPath": "/data", "servedModelName": "demo"},
        "image": "img:1",
        "stages": 2,
        "resources": {"requests": {"cpu": "1", "nvidia.com/gpu": 1}},
        "hicache": {"secretRef": {"name": "redis"}, "hostCacheGB": 4},
        "nccl": {"socketIfname": "eth0", "debug": "INFO"},
        "env": [{"name": "A", "value": "1"}],
        "podLabels": {"team": "x"},
        "podAnnotations": {"note": "y"},
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "nodeSelector": {"pool": "gpu"},
        "serviceAccountName": "sa",
        "placement": {"colocate": "required", "gang": "volcano"},
        "layerSplit": [3, 5],
        "engine": {"max-num-seqs": 4},
    },
}


def _spec_fields() -> set[str]:
    return set(PipelineSpec.__struct_fields__)


def _lookups(source: str) -> list[tuple[str, str]]:
    """(the key, the expression) of every `x["key"]` read and `x.get/pop/setdefault("key", ...)`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            first = node.args[0]
            if node.func.attr in ("get", "pop", "setdefault") and isinstance(first, ast.Constant):
                key = first.value
        if isinstance(key, str):
            out.append((key, ast.unparse(node)))
    return out


def spec_dict_lookups(root: Path = OPERATOR) -> list[str]:
    fields, found = _spec_fields(), []
    for path in sorted(root.glob("*.py")):
        if path.name in EXEMPT_MODULES:
            continue
        for key, expr in _lookups(path.read_text()):
            if key in fields and (path.name, expr) not in ALLOWED:
                found.append(f"{path.name}: {expr}")
    return found


def test_no_module_reads_a_spec_field_from_a_dict() -> None:
    assert spec_dict_lookups() == [], "read the typed model (spec.parse) instead"


def test_the_scan_sees_a_dict_lookup(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text('def f(spec):\n    return spec.get("nodeSelector"), spec["stages"]\n')
    assert set(spec_dict_lookups(tmp_path)) == {"x.py: spec.get('nodeSelector')", "x.py: spec['stages']"}


def test_the_builders_read_the_typed_model_only() -> None:
    body = admitted(CR)
    typed = spec_model.parse(body["spec"])
    meta_only = {"metadata": copy.deepcopy(body["metadata"])}  # no spec: the model is all there is
    for index in (0, 1):
        assert stage_statefulset(meta_only, typed, index, 3) == render(body, index, 3)
        assert pod_group(meta_only, typed, index)["spec"] == {
            "minMember": 2,
            "minResources": {"cpu": "2", "nvidia.com/gpu": "2"},
        }


def test_pass_through_fields_are_fields_of_the_model() -> None:
    assert set(pod.PASSED_THROUGH) <= _spec_fields()


def test_a_misspelt_field_is_an_attribute_error() -> None:
    typed = spec_model.parse(admitted(CR)["spec"])
    try:
        typed.nodeSelecter  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError:
        return
    raise AssertionError("the typed model answered a field it does not have")
