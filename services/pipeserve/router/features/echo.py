"""The prompt side of a response: `prompt_logprobs` (vLLM's extension) and completions' `echo`.

* `prompt_logprobs` (both endpoints, k in 0..MAX_LOGPROBS) is vLLM's list, one entry per prompt
  token: null for the first, else {token id: {logprob, rank, decoded_token}} holding the prompt
  token (with its rank) and the top k (ranks 1..k). Completions carry it per choice, chat at the
  top level; a stream carries it in each choice's first chunk (chat: the role chunk).
* `echo` (completions): the prompt's text comes first in the choice's text (a text prompt as sent,
  token ids decoded). With `logprobs`, the legacy logprobs start with the prompt's tokens, the first
  with null logprob and null top; stage 0 scores the prompt for it (prompt_logprobs = logprobs).
  `max_tokens: 0` is allowed with echo only: the prompt alone is scored (the router asks for one
  token and drops it; finish_reason "length", 0 completion tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeserve.detokenize import IncrementalDetokenizer
from pipeserve.tokenizer import TokenizerAssets

PromptScore = tuple[float, int, list[tuple[int, float]]]  # (logprob, rank, top) of one position


def prompt_logprobs(
    tok: TokenizerAssets, ids: list[int], scores: list[PromptScore], k: int, lp: Callable[[float], float]
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` list for `ids` (scores: positions 1..)."""
    out: list[dict[str, Any] | None] = [None]
    for tid, (logprob, rank, top) in zip(ids[1:], scores, strict=False):
        entry: dict[str, Any] = {}
        for r, (t, v) in enumerate(top[:k], start=1):
            entry[str(t)] = {"logprob": lp(v), "rank": r, "decoded_token": tok.decode([t])}
        entry.setdefault(str(tid), {"logprob": lp(logprob), "rank": rank, "decoded_token": tok.decode([tid])})
        out.append(entry)
    return out


def legacy_prompt_logprobs(
    tok: TokenizerAssets, ids: list[int], scores: list[PromptScore], k: int, lp: Callable[[float], float]
) -> dict[str, list]:
    """Completions' legacy logprobs of the echoed prompt tokens (the first one null)."""
    text = tok.token_text
    detok = IncrementalDetokenizer(tok.decode)
    offsets, length = [], 0
    for t in ids:
        offsets.append(length)
        length += len(detok.push(t))
    tops: list[dict | None] = [None]
    for tid, (v, _, top) in zip(ids[1:], scores, strict=False):
        d = {text(i): lp(x) for i, x in top[:k]}
        d.setdefault(text(tid), lp(v))
        tops.append(d)
    return {
        "tokens": [text(t) for t in ids],
        "token_logprobs": [None, *(lp(s[0]) for s in scores[: len(ids) - 1])],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def join_legacy(prompt: dict[str, list], generated: dict[str, list] | None, shift: int) -> dict[str, list]:
    """The prompt's legacy logprobs then the generated tokens' (their offsets after the echoed text)."""
    if generated is None:
        return prompt
    return {
        "tokens": prompt["tokens"] + generated["tokens"],
        "token_logprobs": prompt["token_logprobs"] + generated["token_logprobs"],
        "top_logprobs": prompt["top_logprobs"] + generated["top_logprobs"],
        "text_offset": prompt["text_offset"] + [o + shift for o in generated["text_offset"]],
    }
