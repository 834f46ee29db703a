"""Every CEL rule (`x-kubernetes-validations`) of the InferencePipeline CRD, run by cel-python on good and
bad example specs, after the API server's pruning and defaulting (crd_support.admitted).

EXAMPLES maps a rule's message (its start) to specs it must accept and specs it must refuse; a rule
without examples fails `test_every_rule_has_examples`, so a new rule brings its examples. A bad example
must reach its rule (the node it sits on exists), and where the builders re-check a rule
(`builder=True`), they refuse the same spec with a SpecError.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from chart_support import k8s_tools
from crd_support import admitted, cel_rules, evaluate, node, render, schema_at

from pipeserve_operator.crd import spec_schema
from pipeserve_operator.resources import SpecError


def cr(**spec: Any) -> dict[str, Any]:
    base = {"model": {"path": "/models/m", "persistentVolumeClaim": "weights"}, "image": "img:1", "stages": 2}
    return {
        "apiVersion": "pipeserve.io/v1alpha1",
        "kind": "InferencePipeline",
        "metadata": {"name": "p", "namespace": "ml", "uid": "u-1"},
        "spec": {**base, **spec},
    }


def model(**fields: Any) -> dict[str, Any]:
    return {"path": "/models/m", **fields}


# message start → (good specs, bad specs, whether the builders refuse the bad ones too)
EXAMPLES: dict[str, tuple[list[dict], list[dict], bool]] = {
    "model.persistentVolumeClaim and model.hostPath": (
        [{"model": model(persistentVolumeClaim="w")}, {"model": model(hostPath="/w")}, {"model": model()}],
        [{"model": model(persistentVolumeClaim="w", hostPath="/w")}],
        True,
    ),
    "hicache.url and hicache.secretRef": (
        [{"hicache": {"url": "redis://r"}}, {"hicache": {"secretRef": {"name": "s"}}}, {"hicache": {}}],
        [{"hicache": {"url": "redis://r", "secretRef": {"name": "s"}}}],
        False,
    ),
    "placement.queueName is required": (
        [{"placement": {"gang": "kueue", "queueName": "q"}}, {"placement": {"gang": "volcano"}}, {}],
        [{"placement": {"gang": "kueue"}}],
        True,
    ),
    "layerSplit must have one entry per stage": (
        [{"layerSplit": [2, 2]}, {}],
        [{"layerSplit": [4]}, {"stages": 3, "layerSplit": [1, 1]}],
        True,
    ),
    "restartBackoffMaxSeconds must be >= restartBackoffSeconds": (
        [{"restartBackoffSeconds": 5, "restartBackoffMaxSeconds": 5}, {"restartBackoffSeconds": 0.5}],
        [{"restartBackoffSeconds": 10, "restartBackoffMaxSeconds": 5.5}, {"restartBackoffSeconds": 301}],
        False,
    ),
    "engine: a flag the operator sets": (
        [{"engine": {"max-num-seqs": 8, "dtype": "float32"}}, {}],
        [
            {"engine": {"device": "cuda"}},
            {"engine": {"connect-timeout-s": 10}},
            {"engine": {"world-size": 4}},
        ],
        True,
    ),
    "env: a name the operator sets": (
        [{"env": [{"name": "A", "value": "1"}, {"name": "T", "valueFrom": {"secretKeyRef": {"key": "k"}}}]}],
        [
            {"env": [{"name": "A", "value": "1"}, {"name": "MASTER_ADDR", "value": "x"}]},
            {"env": [{"name": "HOME", "value": "/"}]},
            {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
        ],
        True,
    ),
    "volumes: a name the operator uses": (
        [{"volumes": [{"name": "cache", "emptyDir": {}}]}],
        [{"volumes": [{"name": "tmp", "emptyDir": {}}]}, {"volumes": [{"name": "dshm", "emptyDir": {}}]}],
        True,
    ),
    "volumeMounts: the operator's volumes": (
        [
            {"volumeMounts": [{"name": "c", "mountPath": "/cache"}]},
            {"model": model(), "volumeMounts": [{"name": "c", "mountPath": "/models"}]},  # no model volume
        ],
        [
            {"volumeMounts": [{"name": "c", "mountPath": "/tmp"}]},
            {"volumeMounts": [{"name": "c", "mountPath": "/dev/shm"}]},
            {"volumeMounts": [{"name": "c", "mountPath": "/models"}]},
            {
                "model": model(hostPath="/w", mountPath="/w"),
                "volumeMounts": [{"name": "c", "mountPath": "/w"}],
            },
            {"volumeMounts": [{"name": "model", "mountPath": "/elsewhere"}]},
        ],
        True,
    ),
    "podLabels: keys under pipeserve.io/": (
        [{"podLabels": {"team": "ml", "example.com/pipeserve.io": "x"}}],
        [
            {"podLabels": {"pipeserve.io/group": "0"}},
            {"podLabels": {"app.kubernetes.io/component": "x"}},
            {"podLabels": {"kueue.x-k8s.io/queue-name": "q"}},
        ],
        True,
    ),
    "podAnnotations: keys under pipeserve.io/": (
        [{"podAnnotations": {"prometheus.io/scrape": "true"}}],
        [
            {"podAnnotations": {"pipeserve.io/x": "1"}},
            {"podAnnotations": {"scheduling.k8s.io/group-name": "g"}},
        ],
        True,
    ),
    "schedulerName: placement.gang volcano": (
        [
            {"placement": {"gang": "volcano"}, "schedulerName": "volcano"},
            {"placement": {"gang": "volcano"}},
            {"schedulerName": "other"},
        ],
        [{"placement": {"gang": "volcano"}, "schedulerName": "default-scheduler"}],
        True,
    ),
}

RULES = list(cel_rules(spec_schema()))


def _key(rule: dict[str, str]) -> str:
    keys = [k for k in EXAMPLES if rule["message"].startswith(k)]
    assert len(keys) == 1, f"no examples for the rule {rule['rule']!r} ({rule['message']!r})"
    return keys[0]


def _check(path: tuple[str, ...], rule: dict[str, str], spec: dict) -> bool:
    """The rule's verdict on the admitted spec (whose node the rule sits on must exist)."""
    assert "[]" not in path and "{}" not in path, "rules under list items or map values: extend node()"
    value = node(admitted(cr(**spec))["spec"], path)
    assert value is not None, f"the example does not reach the rule at {'.'.join(path) or 'spec'}: {spec}"
    return evaluate(rule["rule"], value, schema_at(spec_schema(), path))


def test_every_rule_has_examples() -> None:
    assert len(RULES) >= len(EXAMPLES)
    used = {_key(rule) for _, rule in RULES}
    assert used == set(EXAMPLES), f"examples for rules that do not exist: {set(EXAMPLES) - used}"
    for good, bad, _ in EXAMPLES.values():
        assert good and bad


@pytest.mark.parametrize("path, rule", RULES, ids=[r["message"][:40] for _, r in RULES])
def test_rule_accepts_the_good_and_refuses_the_bad(path: tuple[str, ...], rule: dict[str, str]) -> None:
    good, bad, builder = EXAMPLES[_key(rule)]
    for spec in good:
        assert _check(path, rule, spec), (rule["rule"], spec)
        render(admitted(cr(**spec)), 0, 1)  # a spec admission accepts renders
    for spec in bad:
        assert not _check(path, rule, spec), (rule["rule"], spec)
        if builder:
            with pytest.raises(SpecError):
                render(admitted(cr(**spec)), 0, 1)


def test_what_a_rule_iterates_is_bounded() -> None:
    """The API server estimates each rule's worst-case cost from the schema and refuses a CRD whose
    rule it cannot bound: every list or map a rule iterates has maxItems / maxProperties, and every
    string field of an item it compares has a maxLength."""
    iterated = 0
    for path, rule in RULES:
        schema = schema_at(spec_schema(), path)
        for field, var, body in re.findall(
            r"self\.(\w+)\.(?:all|exists)\((\w+), (.*?)\)\)?(?: \|\||$)", rule["rule"]
        ):
            sub = schema["properties"][field]
            assert sub.get("maxItems") or sub.get("maxProperties"), (field, rule["rule"])
            iterated += 1
            if sub["type"] == "object":  # a map: the rule's variable is a key
                continue
            for prop in set(re.findall(rf"\b{var}\.(\w+)", body)):
                assert sub["items"]["properties"][prop].get("maxLength"), (field, prop)
    assert iterated >= 6


def test_the_charts_example_pipeline_passes_every_rule() -> None:
    """The example InferencePipeline `helm install --set example.enabled=true` creates (GPU or not)."""
    gpu = [
        "--set",
        "example.resources.limits.nvidia\\.com/gpu=1",
        "--set",
        "example.model.persistentVolumeClaim=m",
    ]
    for extra in ([], gpu):
        objects = k8s_tools().objects("--set", "example.enabled=true", *extra)
        (example,) = [o for o in objects if o["kind"] == "InferencePipeline"]
        spec = admitted(example)["spec"]
        for path, rule in RULES:
            value = node(spec, path)
            if value is not None:
                assert evaluate(rule["rule"], value, schema_at(spec_schema(), path)), rule
        sts = render({**admitted(example), "metadata": {**example["metadata"], "uid": "u"}}, 0, 1)
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--device") + 1] == ("cuda" if extra else "cpu")
