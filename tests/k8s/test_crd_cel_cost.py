"""Every CEL rule of the InferencePipeline CRD stays under the API server's cost limits (issue 31, point 4).

Each rule's worst-case cost is estimated as the API server bounds it (cel_cost.py: every list, map and
string a rule touches is sized by its maxItems / maxProperties / maxLength, else by the request size
limit), times how often the rule runs (once per element of every list it sits in), and must stay under
StaticEstimatedCostLimit; all of them together under the CRD's limit. Removing a bound a rule iterates
(corev1.MAX_ITEMS on env, volumes, ...) fails it, as the API server would refuse the CRD.
"""

from __future__ import annotations

import pytest
from cel_cost import (
    STATIC_ESTIMATED_COST_LIMIT,
    STATIC_ESTIMATED_CRD_COST_LIMIT,
    cardinality,
    node_schema,
    rule_cost,
)
from crd_support import cel_rules, cr_schema

RULES = list(cel_rules(cr_schema()))


@pytest.mark.parametrize(("path", "rule"), RULES, ids=[r["message"][:50] for _, r in RULES])
def test_each_rule_is_under_the_per_rule_limit(path: tuple[str, ...], rule: dict) -> None:
    cost = rule_cost(rule["rule"], node_schema(cr_schema(), path)) * cardinality(cr_schema(), path)
    assert 0 < cost <= STATIC_ESTIMATED_COST_LIMIT, (path, rule["rule"], cost)


def test_all_rules_together_are_under_the_crd_limit() -> None:
    root = cr_schema()
    total = sum(rule_cost(r["rule"], node_schema(root, p)) * cardinality(root, p) for p, r in RULES)
    assert len(RULES) >= 10 and total <= STATIC_ESTIMATED_CRD_COST_LIMIT, total


def test_an_unbounded_list_a_rule_iterates_is_over_the_limit() -> None:
    """The estimator can fail: the env rule over a list without maxItems costs millions of steps."""
    root = cr_schema()
    (path, rule) = next((p, r) for p, r in RULES if r["rule"].startswith("!has(self.env)"))
    spec = node_schema(root, path)
    unbounded = {**spec, "properties": {**spec["properties"], "env": dict(spec["properties"]["env"])}}
    del unbounded["properties"]["env"]["maxItems"]
    assert rule_cost(rule["rule"], spec) <= STATIC_ESTIMATED_COST_LIMIT
    assert rule_cost(rule["rule"], unbounded) > STATIC_ESTIMATED_COST_LIMIT
