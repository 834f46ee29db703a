"""The check that a pass timed no cache: by each server's own counts, every prompt token was computed.

A side-by-side on prompts a server already holds times its cache, not its prefill (DESIGN §10.15).
Fresh prompts (bench/prompts.py) are meant to make hits impossible; this module proves it after each
pass from what the servers themselves report, and a pass with hits fails loudly unless it says it
measures caching:

  - per response, any server: `usage.prompt_tokens_details.cached_tokens` of the streamed usage chunk
    (pipeserve's router and llama-server both send it), and llama-server's `timings.cache_n` (prompt
    tokens its slot reused; in the final chunk of a streamed /v1/completions);
  - per server, pipeserve: `pipeserve:prefix_cache_hits_total` (every tier: l1, l2, l3) summed over the
    stages `GET /groups` lists, read before and after the pass — hits the responses might not show.

A server that reports neither (no cached-token figure in any response, no counters) cannot be checked,
and that fails the pass too: an instrument that says nothing must not read as zero (§10.9).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeserve.bench.metrics import RequestResult
from pipeserve.bench.multiturn import scrape_pipeserve

PREFIX_HITS = "pipeserve:prefix_cache_hits_total"


class CacheHitError(RuntimeError):
    """A pass that must compute every prompt token found some served from a cache (or cannot tell).

    `report`: the pass's cache figures (as `check_pass` returns them), when they were read."""

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report


def response_hits(results: Sequence[RequestResult]) -> dict:
    """What the responses say: how many reported a figure, hit tokens summed, requests that hit."""
    reporting = hit_tokens = hit_requests = 0
    for r in results:
        figures = [v for v in (r.cached_tokens, r.cache_n) if v is not None]
        if not figures:
            continue
        reporting += 1
        # Both figures count the same reused prefix where a server sends both: take the larger.
        hit_tokens += max(figures)
        hit_requests += max(figures) > 0
    return {"reporting": reporting, "hit_tokens": hit_tokens, "hit_requests": hit_requests}


@dataclass
class Counters:
    """A pipeserve up's prefix-cache hit counter, summed over its stages; `read()` None elsewhere.

    `required`: the server is known to be pipeserve, so a counter that cannot be read is an error,
    not "another server".
    """

    url: str
    api_key: str | None = None
    required: bool = False

    def read(self) -> float | None:
        got = scrape_pipeserve(self.url, self.api_key, (PREFIX_HITS,))
        if got is None and self.required:
            raise CacheHitError(f"{self.url}: cannot read {PREFIX_HITS} from the stages /groups lists")
        return None if got is None else got[PREFIX_HITS]


def check_pass(
    side: str,
    results: Sequence[RequestResult],
    before: float | None,
    after: float | None,
    measures_caching: bool = False,
) -> dict:
    """The pass's cache figures; raises CacheHitError on any hit (unless `measures_caching`) or when
    neither the responses nor the counters report anything to check."""
    done = [r for r in results if r.success]
    resp = response_hits(done)
    counter = None if before is None or after is None else after - before
    report = {**resp, "counter_hit_tokens": counter, "requests": len(done)}
    if done and resp["reporting"] == 0 and counter is None:
        raise CacheHitError(
            f"{side}: no response reported cached prompt tokens and no prefix-cache counter could be "
            "read: cannot show that this pass computed every prompt token",
            report,
        )
    if measures_caching:
        return report
    if resp["hit_tokens"] or counter:
        raise CacheHitError(
            f"CACHE HITS in a pass that must compute every prompt token ({side}): "
            f"{resp['hit_tokens']} prompt tokens reported cached over {resp['hit_requests']} of "
            f"{len(done)} responses; prefix-cache counter grew by {counter}. The prompts were not fresh.",
            report,
        )
    return report
