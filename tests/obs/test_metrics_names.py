"""docs/metrics.md against a live `pipeserve up --stages 2`: every documented metric is exported by
the process the doc names (with its type and labels), every exported `pipeserve:` family is documented
for that process; and the numbers the requests must have moved did move."""

from __future__ import annotations

import pytest

from metrics_support import documented, mismatches, parse_exposition
from serving_support import metric, metric_sum


@pytest.mark.slow
def test_documented_metrics_are_exactly_what_each_process_exports(live_scrape) -> None:
    docs = documented()
    assert len({d.name for d in docs}) == len(docs), "a metric is documented twice"
    assert all(d.type in ("counter", "gauge", "histogram") for d in docs)
    assert all(d.name.endswith("_total") == (d.type == "counter") for d in docs), "_total: counters only"
    assert mismatches(docs, live_scrape.scrapes, live_scrape.conditions) == []


@pytest.mark.slow
def test_the_check_fails_on_a_wrong_doc_or_an_undocumented_metric(live_scrape) -> None:
    """The comparison above can fail: a wrong type, a missing row, a metric nobody exports."""
    docs = documented()
    ttft = next(d for d in docs if d.name == "pipeserve:time_to_first_token_seconds")
    wrong = [d if d is not ttft else type(d)(d.name, "gauge", d.labels, d.process, d.when) for d in docs]
    assert any(
        "documented gauge" in p for p in mismatches(wrong, live_scrape.scrapes, live_scrape.conditions)
    )
    fewer = [d for d in docs if d is not ttft]
    assert mismatches(fewer, live_scrape.scrapes, live_scrape.conditions) == [
        "stage0 exports pipeserve:time_to_first_token_seconds, not documented for it"
    ]
    ghost = type(ttft)("pipeserve:ghost_total", "counter", frozenset({"rank"}), "every stage", "-")
    assert len(mismatches([*docs, ghost], live_scrape.scrapes, live_scrape.conditions)) == 2


@pytest.mark.slow
def test_the_requests_moved_the_engine_and_router_families(live_scrape) -> None:
    stage0, router = live_scrape.texts["stage0"], live_scrape.texts["router"]
    assert metric(stage0, "pipeserve:request_success_total", finished_reason="length") == 3
    assert metric(stage0, "pipeserve:generation_tokens_total") == 18
    assert metric(stage0, "pipeserve:time_to_first_token_seconds_count") == 3
    assert metric(stage0, "pipeserve:e2e_request_latency_seconds_count") == 3
    assert metric(stage0, "pipeserve:request_queue_time_seconds_count") == 3
    assert metric(stage0, "pipeserve:request_time_per_output_token_seconds_count") == 3
    assert (metric(stage0, "pipeserve:inter_token_latency_seconds_count") or 0) >= 3 * 5 - 3  # >=1 per step
    prompt = metric(stage0, "pipeserve:prompt_tokens_total") or 0
    assert prompt > 0 and (metric(stage0, "pipeserve:prefix_cache_queries_total") or 0) > 0
    assert metric_sum(stage0, "pipeserve:prefix_cache_hits_total") > 0, "the repeated prompt hit no cache"
    for text in (stage0, live_scrape.texts["stage1"]):
        assert (metric(text, "pipeserve:stage_busy_seconds_total") or 0) > 0
        assert metric(text, "pipeserve:stage_ready") == 1 and metric(text, "pipeserve:stage_wedged") == 0
    assert metric(router, "pipeserve:router_requests_total", endpoint="/v1/completions", status="200") == 3
    assert metric(router, "pipeserve:router_requests_total", endpoint="other", status="404") == 1
    assert metric(router, "pipeserve:router_generation_tokens_total") == 18
    assert metric(router, "pipeserve:group_restarts_total", group="group-0", cause="group_stop") == 0


def test_parse_exposition_reads_types_and_labels() -> None:
    text = (
        '# TYPE pipeserve:a_total counter\npipeserve:a_total{rank="0",x="1"} 2.0\n'
        '# TYPE pipeserve:h histogram\npipeserve:h_bucket{le="+Inf"} 1.0\npipeserve:h_sum 1.0\n'
        "pipeserve:h_count 1.0\n# TYPE pipeserve:h_created gauge\npipeserve:h_created 1.0\n"
        "# TYPE other gauge\nother 1.0\n"
    )
    got = parse_exposition(text)
    assert {k: (v.type, sorted(v.labels)) for k, v in got.items()} == {
        "pipeserve:a": ("counter", ["rank", "x"]),
        "pipeserve:h": ("histogram", []),
    }
