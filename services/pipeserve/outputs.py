"""Results returned by the offline API (vLLM's RequestOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # Per generated token: (logprob of the token, [(token_id, logprob)] top-k), when asked.
    logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    # prompt_logprobs asked: per prompt position, None for the first, else (logprob of the prompt
    # token, its rank, [(token_id, logprob)] top k)
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]] | None] | None = None
