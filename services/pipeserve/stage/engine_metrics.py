"""The metrics a stage's side port reads at scrape time from the engine (docs/metrics.md).

  busy_metrics(meter)  every stage: seconds spent executing plans (a counter, so rate() is the
                       busy ratio over any window) and the ratio since the stage's first plan
  engine_metrics(loop) stage 0: the engine families in vLLM's names with the `pipeserve:` prefix
                       (running/waiting, KV usage, tokens, finished requests by reason) and the
                       request-timing histograms of stage/request_metrics.py

Stage 0's numbers come from `loop.stats` (replaced, never mutated, after every pass of the loop)
and from objects the loop's thread owns, read without locks: a scrape may be one step stale.
"""

from __future__ import annotations

from pipeserve.care.health import Metric
from pipeserve.engine.executor import BusyMeter
from pipeserve.engine.request import FinishReason
from pipeserve.stage.engine_loop import EngineLoop

P = "pipeserve:"
# request_success_total's finished_reason values (vLLM's); ERROR is counted in request_errors_total.
SUCCESS_REASONS = (FinishReason.STOP.value, FinishReason.LENGTH.value, FinishReason.ABORT.value)


def busy_metrics(meter: BusyMeter) -> dict[str, Metric]:
    wall = meter.wall_s
    return {
        P + "stage_busy_seconds": Metric("counter", "seconds this stage spent executing plans", meter.busy_s),
        P + "stage_busy_ratio": Metric(
            "gauge",
            "busy seconds / wall seconds since this stage's first plan",
            meter.busy_s / wall if wall else 0.0,
        ),
    }


def engine_metrics(loop: EngineLoop) -> dict[str, Metric]:
    s = loop.stats
    engine = loop.engine
    # Blocks each stage reported holding after the last step (stage 0's view of the group).
    held = {str(r.rank): float(r.blocks_held) for r in engine.stage_reports}
    finished = s.requests_finished
    usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
    bm = engine.block_manager
    return {
        P + "num_requests_running": Metric("gauge", "requests being computed", s.running),
        P + "num_requests_waiting": Metric("gauge", "requests queued for admission", s.waiting),
        P + "kv_cache_usage_perc": Metric("gauge", "fraction of the KV pool held by requests (0..1)", usage),
        P + "kv_blocks_used": Metric("gauge", "KV blocks held by requests", s.kv_blocks_used),
        P + "kv_pool_blocks": Metric("gauge", "KV blocks in the pool", s.kv_blocks_total),
        P + "group_stage_blocks_held": Metric(
            "gauge", "KV blocks each stage held after the last step", label="stage", values=held
        ),
        P + "generation_tokens": Metric("counter", "tokens generated", s.tokens_generated),
        P + "request_success": Metric(
            "counter",
            "requests finished, by finish reason (stop, length, abort)",
            label="finished_reason",
            values={r: float(finished.get(r, 0)) for r in SUCCESS_REASONS},
        ),
        P + "request_errors": Metric(
            "counter", "requests that failed on some stage (finish reason error)", finished.get("error", 0)
        ),
        P + "prefix_cache_queries": Metric(
            "counter", "prompt tokens looked up in the prefix cache", bm.stats.queried_tokens
        ),
        P + "prefix_cache_hits": Metric(
            "counter",
            "prompt tokens served from a cache tier (l1: GPU, l2: host, l3: Redis)",
            label="tier",
            values={t: float(engine.scheduler.fetch.stats.hit_tokens.get(t, 0)) for t in ("l1", "l2", "l3")},
        ),
        **loop.timer.metrics(),
    }
