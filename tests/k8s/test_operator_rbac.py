"""The chart grants the operator exactly what its code uses: the union of `kube.NEEDS` (one entry per
Kube method) and `kube.KOPF_NEEDS` (kopf's own watch and Events), rendered with `helm template` for a
cluster-wide and a one-namespace operator; cluster-scoped resources (nodes) only in a ClusterRole."""

from __future__ import annotations

import inspect

import pytest
from chart_support import k8s_tools

from pipeserve_operator.kube import CLUSTER_SCOPED, KOPF_NEEDS, NEEDS, Kube


def _granted(objects: list[dict]) -> dict[tuple[str, str, str], str]:
    """(group, resource, verb) → the kind of role granting it, over the operator's roles."""
    out: dict[tuple[str, str, str], str] = {}
    for o in objects:
        if o["kind"] in ("Role", "ClusterRole") and o["metadata"]["name"].startswith(
            "rel-pipeserve-operator"
        ):
            for rule in o["rules"]:
                for g in rule["apiGroups"]:
                    for r in rule["resources"]:
                        for v in rule["verbs"]:
                            out[(g, r, v)] = o["kind"]
    return out


def test_every_kube_method_declares_its_rights() -> None:
    methods = {n for n, f in inspect.getmembers(Kube, inspect.iscoroutinefunction) if not n.startswith("_")}
    assert methods == set(NEEDS), methods ^ set(NEEDS)


@pytest.mark.parametrize("watch", ["", "team-a"])
def test_chart_rules_equal_the_declared_needs(watch: str) -> None:
    objects = k8s_tools().objects("--set", f"operator.watchNamespace={watch}")
    granted = _granted(objects)
    assert set(granted) == set(NEEDS.values()) | KOPF_NEEDS, set(granted) ^ (set(NEEDS.values()) | KOPF_NEEDS)
    for (_, resource, _), kind in granted.items():
        if resource in CLUSTER_SCOPED:
            assert kind == "ClusterRole", resource
