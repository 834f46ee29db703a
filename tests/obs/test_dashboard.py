"""charts/pipeserve/dashboards/pipeserve.json: importable as is (Grafana's schema essentials, a
`DS_PROMETHEUS` datasource variable), every panel's PromQL parsed with promql_parser, and every metric
it queries exported by a running router or stage (the live `pipeserve up` of tests/obs/conftest.py)."""

from __future__ import annotations

import pytest

from metrics_support import (
    dashboard_exprs,
    family_of,
    load_dashboard,
    misspell,
    selectors,
    unknown_in_dashboard,
)

# What an operator must find on the dashboard (issue 13): families each panel set must query.
REQUIRED = {
    "throughput": {"pipeserve:prompt_tokens_total", "pipeserve:generation_tokens_total"},
    "TTFT / ITL / E2E": {
        "pipeserve:time_to_first_token_seconds_bucket",
        "pipeserve:inter_token_latency_seconds_bucket",
        "pipeserve:e2e_request_latency_seconds_bucket",
        "pipeserve:router_time_to_first_token_seconds_bucket",
    },
    "queue": {"pipeserve:request_queue_time_seconds_bucket"},
    "running / waiting": {"pipeserve:num_requests_running", "pipeserve:num_requests_waiting"},
    "KV usage": {"pipeserve:kv_cache_usage_perc"},
    "cache hit ratios": {
        "pipeserve:prefix_cache_hits_total",
        "pipeserve:prefix_cache_queries_total",
        "pipeserve:hicache_l3_group_loads_total",
    },
    "stage busy": {"pipeserve:stage_busy_seconds_total"},
    "restarts and wedges": {"pipeserve:group_restarts_total", "pipeserve:stage_wedged"},
    "router retries / errors": {"pipeserve:router_retries_total", "pipeserve:router_upstream_errors_total"},
}


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_is_importable_as_is() -> None:
    d = load_dashboard()
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["uid"] == "pipeserve-overview" and d["title"]
    (ds,) = [v for v in d["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(g) and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    for p in _panels(d):
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"]), p["title"]


def test_every_expr_parses_and_the_required_panels_are_there() -> None:
    used = {name for _, expr in dashboard_exprs(load_dashboard()) for name in selectors(expr)}
    missing = {what: sorted(names - used) for what, names in REQUIRED.items() if names - used}
    assert missing == {}


def test_selectors_come_from_the_parser() -> None:
    expr = (
        'sum by (tier) (rate(a:b_total{x="rate(c_total[5m])"}[$__rate_interval]))'
        " / ignoring (tier) group_left d"
    )
    assert selectors(expr) == ["a:b_total", "d"]  # a string that looks like PromQL is not a selector
    with pytest.raises(ValueError, match="unclosed left parenthesis"):
        selectors("sum(rate(x[5m])")


@pytest.mark.slow
def test_every_metric_the_dashboard_queries_is_exported(live_scrape) -> None:
    assert unknown_in_dashboard(load_dashboard(), live_scrape.exported()) == []


@pytest.mark.slow
def test_a_misspelt_metric_is_caught(live_scrape) -> None:
    exported = live_scrape.exported()
    bad = misspell(load_dashboard(), "pipeserve:num_requests_waiting", "pipeserve:num_request_waiting")
    want = ["Running and waiting requests: pipeserve:num_request_waiting"]
    assert unknown_in_dashboard(bad, exported) == want
    # A counter queried without _total, a histogram without _bucket: not what is exported either.
    assert family_of("pipeserve:router_retries", exported) is None
    assert family_of("pipeserve:time_to_first_token_seconds", exported) is None
    assert family_of("pipeserve:time_to_first_token_seconds_bucket", exported) == (
        "pipeserve:time_to_first_token_seconds"
    )
