"""The chart's example InferencePipeline and who owns the router's policy (issue 31, point 6).

* example.placement / example.rollout are accepted by values.schema.json with the resource's own
  choices (the enums of pod.py, which the CRD offers too) and reach the resource, which the CRD's
  schema accepts.
* One precedence for the picking policy: the InferencePipeline's spec.router.policy, which the router
  follows live. The chart passes the router no --policy (a flag would override every later edit of the
  resource); router.policy only writes the example's spec.router.policy, and is refused without the
  example; a router.pipelines entry cannot pin a policy either.
"""

from __future__ import annotations

import json

import pytest
from chart_support import CHART, Tools, k8s_tools
from test_chart import cr_errors

from pipeserve_operator.crd import spec_schema
from pipeserve_operator.pod import COLOCATE, GANGS

EXAMPLE = ["--set", "example.enabled=true"]


@pytest.fixture(scope="module")
def tools() -> Tools:
    return k8s_tools()


def _example(objects: list[dict]) -> dict:
    return next(o for o in objects if o["kind"] == "InferencePipeline")


def _router_args(objects: list[dict]) -> list[str]:
    (router,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router")
    ]
    return router["spec"]["template"]["spec"]["containers"][0]["args"]


def test_example_placement_and_rollout_reach_the_resource(tools: Tools) -> None:
    placement = {"colocate": "required", "topologyKey": "topology.kubernetes.io/zone", "gang": "kueue"}
    placement["queueName"] = "gpu-queue"
    values = {"placement": placement, "rollout": {"maxSurge": 0, "partition": 1}}
    objects = tools.objects(*EXAMPLE, "--set-json", f"example={json.dumps({'enabled': True, **values})}")
    cr = _example(objects)
    assert cr["spec"]["placement"] == placement and cr["spec"]["rollout"] == values["rollout"]
    assert cr_errors(cr) == []
    lint = tools.run(
        tools.helm, "lint", "--strict", CHART, "--set-json", f"example.placement={json.dumps(placement)}"
    )
    assert "0 chart(s) failed" in lint.stdout
    # Unset: the resource's defaults apply (no placement, no rollout written).
    assert "placement" not in _example(tools.objects(*EXAMPLE))["spec"]


def test_values_schema_offers_the_resources_choices() -> None:
    values = json.loads((CHART / "values.schema.json").read_text())["properties"]["example"]["properties"]
    crd = spec_schema()["properties"]
    for field in ("placement", "rollout"):
        assert set(values[field]["properties"]) == set(crd[field]["properties"]), field
    assert values["placement"]["properties"]["colocate"]["enum"] == list(COLOCATE)
    assert values["placement"]["properties"]["gang"]["enum"] == list(GANGS)


def test_the_resource_owns_the_router_policy(tools: Tools) -> None:
    objects = tools.objects(*EXAMPLE, "--set", "router.policy=least_load")
    assert "--policy" not in _router_args(objects)  # a flag would override live edits of the resource
    assert _example(objects)["spec"]["router"] == {"policy": "least_load"}
    assert "--policy" not in _router_args(tools.objects())
    r = tools.template("--set", "router.policy=least_load", check=False)
    assert r.returncode != 0 and "spec.router.policy" in r.stderr, r.stderr
