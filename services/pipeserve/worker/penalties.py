"""Logits processors (vLLM's definitions) and the token history they read: the last stage's.

Applied by the sampler before temperature/top-k/top-p/min-p, in vLLM's order,
to greedy rows as to random ones:
1. `min_tokens`: while a request has fewer than `min_tokens` output tokens,
   its `min_tokens_stop_ids` (EOS unless ignore_eos, and stop_token_ids) are
   -inf (the router likewise applies no stop string before it);
2. `logit_bias`: logits[token] += bias;
3. `repetition_penalty` (HF's definition) over the prompt and output tokens:
   a positive logit is divided by it, a negative one multiplied;
   `frequency_penalty` and `presence_penalty` over the output tokens only:
   logits -= frequency * count + presence * (count > 0).
Logprobs stay those of the raw distribution (vLLM's default `raw_logprobs`):
the sampler computes them from the logits before these processors.

A batch in which no row uses a processor is returned as is (no copy), so the
unconstrained path pays one scan of the specs. Results may overflow float32
(a logit / 0.01): the sampler re-applies its non-finite clean-up after them.

Where the history lives (DESIGN: only stage 0 decides): `TokenHistories` on
the last stage, rebuilt from the plan alone. A request whose spec needs it
(`needs_history`, engine/plan.py: stage 0 reads it too) starts one when it
enters (NewRequest.history: the tokens before its first chunk, i.e. a
prefix-cache hit), each chunk appends its
tokens, and it is dropped when the plan frees the request — so a preempted
request, re-admitted with all its tokens to recompute, starts afresh. A chunk
that does not continue the history, or that does not begin with the token
this stage sampled for it, is a PlanMismatch (the caller raises it).
Outputs so far are the last `sample_index` tokens of the history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeserve.engine.plan import needs_history

if TYPE_CHECKING:
    from pipeserve.engine.plan import SamplingSpec


def uses_processors(spec: SamplingSpec) -> bool:
    return needs_history(spec) or bool(spec.logit_bias) or spec.min_tokens > 0


class TokenHistories:
    """Token ids [0, n) of each request whose penalties need them (last stage only)."""

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}
        self._sampled: dict[str, int] = {}  # the token this stage sampled, due as the next chunk's first

    def admit(self, req_id: str, spec: SamplingSpec, prefix: list[int]) -> None:
        if needs_history(spec):  # after `free` of an earlier admission (preemption): starts afresh
            self._tokens.setdefault(req_id, []).extend(prefix)

    def free(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)
        self._sampled.pop(req_id, None)

    def extend(self, req_id: str, start_pos: int, token_ids: list[int]) -> str | None:
        """Append a chunk's tokens; the reason it does not continue the history, or None."""
        hist = self._tokens.get(req_id)
        if hist is None:
            return None
        if start_pos != len(hist):
            return f"{req_id!r} chunk starts at {start_pos}, its token history holds {len(hist)}"
        due = self._sampled.pop(req_id, None)
        if due is not None and token_ids[:1] != [due]:
            return f"{req_id!r} chunk begins with {token_ids[:1]}, this stage sampled {due}"
        hist += token_ids
        return None

    def sampled(self, req_id: str, token_id: int) -> None:
        if req_id in self._tokens:
            self._sampled[req_id] = token_id

    def get(self, req_id: str) -> list[int] | None:
        return self._tokens.get(req_id)

    def __len__(self) -> int:
        return len(self._tokens)


def apply_processors(
    logits: torch.Tensor,
    specs: list[SamplingSpec],
    sample_indices: list[int],
    histories: list[list[int] | None] | None,
) -> torch.Tensor:
    """[R, V] float32 logits -> processed logits; `logits` itself when no row uses a processor."""
    rows = [i for i, s in enumerate(specs) if uses_processors(s)]
    if not rows:
        return logits
    out = logits.clone()
    dev = logits.device
    vocab = logits.shape[-1]
    for i in rows:
        s = specs[i]
        row = out[i]
        if sample_indices[i] < s.min_tokens and s.min_tokens_stop_ids:
            row[torch.tensor(s.min_tokens_stop_ids, device=dev)] = float("-inf")
        if s.logit_bias:
            ids = torch.tensor([t for t, _ in s.logit_bias], device=dev)
            row[ids] += torch.tensor([b for _, b in s.logit_bias], device=dev, dtype=row.dtype)
        if not needs_history(s):
            continue
        hist = (histories[i] if histories is not None else None) or []
        if s.repetition_penalty != 1 and hist:
            seen = torch.tensor(sorted(set(hist)), device=dev)
            vals = row[seen]
            scaled = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
            # A huge penalty must not turn a finite negative logit into -inf: a row all -inf has no
            # distribution. (+inf from a tiny one is the sampler's clean-up: the largest float.)
            big = torch.finfo(scaled.dtype).max
            row[seen] = torch.where(vals.isfinite(), scaled.clamp(min=-big), vals)
        n_out = sample_indices[i]
        if (s.frequency_penalty or s.presence_penalty) and n_out > 0:
            outputs = torch.tensor(hist[len(hist) - n_out :], device=dev)
            counts = torch.bincount(outputs, minlength=vocab)[:vocab].to(row.dtype)
            row -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(row.dtype)
    return out
