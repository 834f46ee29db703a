"""HiCache metrics of a stage, read at scrape time from the objects that own them.

Every stage: its L2 pool (slots, saves, loads), its L3 loads by answer
(ok / late / missing / checksum / layout / format / unavailable), pages and
bytes moved, the fetch latency histogram, the store queue (depth, drops,
failures) and whether Redis answers. Stage 0 adds the group's view: its L2
index, probes, and how the group's loads ended. Names: `pipeserve:hicache_*` (docs/metrics.md).
"""

from __future__ import annotations

from pipeserve.care.health import Metric
from pipeserve.engine.engine import LLMEngine
from pipeserve.hicache.stage_tiers import StageTiers


def stage_tier_metrics(tiers: StageTiers | None) -> dict[str, Metric]:
    if tiers is None:
        return {}
    s = tiers.stats
    buckets, total = s.l3_load_seconds.snapshot()
    out = {
        "pipeserve:hicache_l2_slots": Metric(
            "gauge", "L2 (host memory) slots of this stage", tiers.host_slots
        ),
        "pipeserve:hicache_l2_saves": Metric(
            "counter", "blocks copied L1 -> L2 (evicted from L1)", s.l2_saves
        ),
        "pipeserve:hicache_l2_loads": Metric("counter", "blocks copied L2 -> L1 (prefix hits)", s.l2_loads),
    }
    if tiers.tier is None:
        return out
    out |= {
        "pipeserve:hicache_l3_loads": Metric(
            "counter",
            "L3 load orders this stage answered, by answer",
            label="status",
            values=dict(s.l3_loads),
        ),
        "pipeserve:hicache_l3_blocks_loaded": Metric(
            "counter", "pages loaded from L3 into L1", s.l3_blocks_loaded
        ),
        "pipeserve:hicache_l3_read_bytes": Metric("counter", "page bytes read from L3", s.l3_bytes_read),
        "pipeserve:hicache_l3_load_seconds": Metric(
            "histogram", "time to fetch and check one load's pages", total, buckets=buckets
        ),
    }
    if (w := tiers.writer) is not None:
        ws = w.stats
        out |= {
            "pipeserve:hicache_l3_stores": Metric("counter", "pages written to L3", ws.written),
            "pipeserve:hicache_l3_written_bytes": Metric("counter", "bytes written to L3", ws.bytes_written),
            "pipeserve:hicache_l3_store_queue": Metric("gauge", "pages waiting to be written", w.queue_depth),
            "pipeserve:hicache_l3_store_batches": Metric(
                "counter", "pipelines of pages sent to L3", ws.batches
            ),
            "pipeserve:hicache_l3_store_throttled_seconds": Metric(
                "counter", "time the write rate cap held the writer back", ws.throttled_s
            ),
            "pipeserve:hicache_l3_store_dropped": Metric(
                "counter", "pages not written: the store queue was full", ws.dropped_full
            ),
            "pipeserve:hicache_l3_store_failed": Metric(
                "counter", "pages not written: Redis refused or timed out", ws.failed + ws.dropped_down
            ),
            "pipeserve:hicache_l3_up": Metric(
                "gauge", "1 while this stage's last Redis write succeeded", w.available
            ),
        }
    return out


def leader_tier_metrics(engine: LLMEngine) -> dict[str, Metric]:
    sched = engine.scheduler
    st = sched.fetch.stats
    bm = engine.block_manager
    out: dict[str, Metric] = {}  # the prefix-cache queries and hits by tier: stage/engine_metrics.py
    if bm.host is not None:
        hs = bm.host.stats
        out |= {
            "pipeserve:hicache_l2_used_slots": Metric("gauge", "L2 slots holding a block", bm.host.used),
            "pipeserve:hicache_l2_hit_blocks": Metric("counter", "prefix blocks found in L2", hs.hits),
            "pipeserve:hicache_l2_evictions": Metric("counter", "L2 entries dropped for room", hs.evictions),
        }
    if sched.fetch.l3 is not None and (writes := sched.fetch.writes) is not None:
        ws = writes.stats
        buckets, total = st.load_seconds.snapshot()
        out |= {
            "pipeserve:hicache_l3_probes": Metric("counter", "presence queries to L3", st.probes),
            "pipeserve:hicache_l3_probe_hit_blocks": Metric(
                "counter", "blocks L3 held for every stage when asked", st.probe_hit_blocks
            ),
            "pipeserve:hicache_l3_probe_wait_seconds": Metric(
                "counter", "time the scheduler waited for fresh probe answers", st.probe_wait_s
            ),
            "pipeserve:hicache_l3_probe_waits_expired": Metric(
                "counter", "probe waits that ended with a probe unanswered", st.probe_waits_expired
            ),
            "pipeserve:hicache_l3_group_loads": Metric(
                "counter",
                "L3 loads by outcome: ok (every stage in time) or the first failing stage's answer",
                label="outcome",
                values=dict(st.loads),
            ),
            "pipeserve:hicache_l3_group_load_seconds": Metric(
                "histogram", "load ordered -> every stage answered", total, buckets=buckets
            ),
            "pipeserve:hicache_l3_pages_ordered": Metric(
                "counter", "blocks ordered written to L3", ws.ordered
            ),
            "pipeserve:hicache_l3_first_sightings": Metric(
                "counter", "blocks not ordered written: seen once (second-hit)", ws.first_sightings
            ),
            "pipeserve:hicache_l3_reused_unstored": Metric(
                "counter",
                "paced blocks reused before their store left, dropped (a buffer was full)",
                ws.dropped_reused,
            ),
            "pipeserve:hicache_l3_store_backlog": Metric(
                "gauge", "blocks ordered written, waiting for the write pacing", writes.backlog
            ),
            "pipeserve:hicache_l3_directory_up": Metric(
                "gauge",
                "1 while stage 0's presence queries reach Redis",
                getattr(sched.fetch.l3, "available", 1),
            ),
            "pipeserve:hicache_l3_directory_errors": Metric(
                "counter", "presence queries Redis failed to answer", getattr(sched.fetch.l3, "errors", 0)
            ),
        }
    return out
