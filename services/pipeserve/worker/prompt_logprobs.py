"""prompt_logprobs, the executing side: the last stage scores the prompt rows stage 0 named.

A chunk's first `score_rows` rows score the prompt tokens after them (engine/prompt_logprobs.py
says which, and how stage 0 keeps the results). `score` takes float32 `log_softmax` of those
rows' logits in slices of SLICE_ROWS rows, so a long prompt never holds [len, vocab] at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeserve.engine.plan import PromptScores, ScheduledChunk

SLICE_ROWS = 256  # rows of [rows, vocab] float32 logits held at once


def targets(chunk: ScheduledChunk) -> list[int]:
    """The prompt tokens the chunk's scored rows score."""
    return ([*chunk.token_ids[1:], chunk.score_next])[: chunk.score_rows]


@torch.inference_mode()
def score(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    row: int,
    chunk: ScheduledChunk,
    k: int,
) -> PromptScores:
    """The chunk's scores from its rows of `hidden` (the last stage's output), `row` its first."""
    want = torch.tensor(targets(chunk), dtype=torch.long, device=hidden.device)
    lps: list[float] = []
    ranks: list[int] = []
    top: list[list[tuple[int, float]]] = []
    for a in range(0, chunk.score_rows, SLICE_ROWS):
        b = min(a + SLICE_ROWS, chunk.score_rows)
        logp = compute_logits(hidden[row + a : row + b]).float().log_softmax(dim=-1)
        chosen = logp.gather(1, want[a:b, None])
        lps += chosen[:, 0].tolist()
        ranks += ((logp > chosen).sum(dim=-1) + 1).tolist()
        if k:
            v, i = logp.topk(min(k, logp.shape[-1]), dim=-1)
            top += [list(zip(ii, vv, strict=True)) for ii, vv in zip(i.tolist(), v.tolist(), strict=True)]
        else:
            top += [[] for _ in range(b - a)]
    return PromptScores(chunk.req_id, chunk.start_pos + 1, lps, ranks, top)
