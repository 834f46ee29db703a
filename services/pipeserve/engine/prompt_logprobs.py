"""prompt_logprobs (vLLM's extension), the deciding side: which rows score, and keeping the scores.

Each prompt token's logprob, rank and the top k there.

Who does what (DESIGN: only stage 0 decides):
* stage 0 (`chunk_scoring`) names, per prefill chunk, how many of its rows score a prompt token
  (`ScheduledChunk.score_rows`) and, when the last of them scores the next chunk's first token,
  that token (`score_next`): the last stage only has the chunk it runs. Row i of a chunk starting
  at position s scores the prompt token at position s + 1 + i; position 0 has no score.
* the last stage (worker/prompt_logprobs.py `score`) takes float32 `log_softmax` of those rows'
  logits and returns `PromptScores` in `StepOutput.prompt_scores`, along the ring to stage 0.
* stage 0 (`keep`) appends each position once, in order: a recompute after preemption scores
  positions it already holds again, and the first value stays; a position past the next one
  expected (a gap) or a chunk whose scores are missing or of the wrong size is a ValueError,
  which the scheduler raises as ResultMismatch (the group stops).
A request with prompt_logprobs takes no prefix-cache hit (L1/L2) and no L3 load (vLLM v1 does
the same: cached positions would have no logits), but its full blocks still enter the cache.
"""

from __future__ import annotations

from pipeserve.engine.plan import PromptScores, ScheduledChunk

PromptScore = tuple[float, int, list[tuple[int, float]]]  # (logprob, rank, top k)


def chunk_scoring(prompt: list[int], start: int, n: int) -> tuple[int, int]:
    """(score_rows, score_next) of a chunk over positions [start, start + n) of a request whose
    prompt is `prompt`: rows scoring positions start + 1 .. up to the prompt's last position."""
    rows = max(0, min(start + n, len(prompt) - 1) - start)
    follows = start + n  # the position the chunk's last row scores
    return rows, (prompt[follows] if rows == n and follows < len(prompt) else -1)


def keep(held: list[PromptScore], chunk: ScheduledChunk, got: PromptScores | None) -> None:
    """Append the chunk's new positions to `held` (positions 1.. in order); ValueError on a
    missing or mis-sized result or a gap."""
    if got is None or got.first_pos != chunk.start_pos + 1 or len(got.logprobs) != chunk.score_rows:
        raise ValueError(f"prompt scores of {chunk.req_id} at {chunk.start_pos} missing or mis-sized")
    for i, (lp, rank, top) in enumerate(zip(got.logprobs, got.ranks, got.top, strict=True)):
        pos = got.first_pos + i
        expected = len(held) + 1
        if pos < expected:
            continue  # recomputed after preemption: the first value stays
        if pos > expected:
            raise ValueError(f"prompt scores of {chunk.req_id}: position {pos} before {expected}")
        held.append((lp, rank, list(top)))
