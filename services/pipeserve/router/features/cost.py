"""What one request may cost (issue 29, point 5): checked at the router once its prompts are
tokenized and max_tokens resolved, before anything reaches a group.

* **Prompt scoring**: the prompt tokens a request has scored times the logprobs asked at each
  (prompt_logprobs, or echo's logprobs; at least 1: a position's own logprob is a full lm_head
  row and a log_softmax over the vocabulary), summed over its prompts. Above
  RouterConfig.max_prompt_scoring: a 400 naming the field the client sent (`prompt_logprobs`,
  or `logprobs` when echo asked for the scores).
* **Generation**: the tokens a request may make: prompts x best_of (n when best_of is not sent)
  x max_tokens, every candidate running to its max_tokens at worst. Above
  RouterConfig.max_generated_tokens: a 400 naming `best_of`, `n` or the max_tokens field the
  client sent (chat: max_completion_tokens), whichever multiplies the cost.
Both errors are OpenAI's shape (router/errors.py) and say the product, its factors and the flag
that sets the limit, so a client knows what to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeserve.router import errors
from pipeserve.sampling_params import SamplingParams


def check_cost(
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    n: int,
    best_of: int,
    max_tokens_param: str,
    scoring_param: str,
    max_prompt_scoring: int,
    max_generated_tokens: int,
) -> None:
    """Raise APIError(400) when the request costs more than the limits; `params` are resolved
    (max_tokens set), one per prompt; `scoring_param` the field that asked for prompt scores."""
    scored = sum(
        len(ids) * max(1, p.prompt_logprobs)
        for ids, p in zip(prompts, params, strict=True)
        if p.prompt_logprobs is not None
    )
    if scored > max_prompt_scoring:
        tokens = sum(len(ids) for ids in prompts)
        k = max(p.prompt_logprobs or 0 for p in params)
        raise errors.invalid(
            scoring_param,
            f"the request asks {scored} prompt scores ({tokens} prompt tokens x {max(1, k)} logprobs), "
            f"over this server's limit of {max_prompt_scoring} per request (--max-prompt-scoring): "
            "ask fewer logprobs or score a shorter prompt",
        )
    generated = sum(best_of * (p.max_tokens or 0) for p in params)
    if generated > max_generated_tokens:
        param = "best_of" if best_of > n else "n" if n > 1 else max_tokens_param
        raise errors.invalid(
            param,
            f"the request may generate {generated} tokens ({len(prompts)} prompts x {best_of} "
            f"candidates (n/best_of) x {max_tokens_param} {max(p.max_tokens or 0 for p in params)}), "
            f"over this server's limit of {max_generated_tokens} per request (--max-generated-tokens): "
            f"lower n/best_of or {max_tokens_param}",
        )
