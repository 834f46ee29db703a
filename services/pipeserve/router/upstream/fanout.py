"""`n` and `best_of`: one prompt fanned out into several upstream requests, and folded back.

Contract (vLLM's and OpenAI's):
* A prompt with `best_of` candidates (`best_of` = n unless the client set it) is a `Family`:
  candidate j is an ordinary Generate call with request id `<id>-<prompt>-<j>`. With a `seed`,
  candidate j samples with seed + j (mod 2**64), so candidate j equals a separate request sent
  with seed + j; without one, each draws from the stage's generator.
* Returned choice index = prompt index × n + j (j < n). With best_of > n (never streamed), every
  candidate runs to its end and the n with the highest cumulative logprob (sum of the sampled
  tokens' logprobs) are returned, best first; candidates ask stage 0 for those logprobs even when
  the client did not (the Formatter then leaves them out of the response).
* prompt_logprobs (and echo's prompt logprobs) are asked of the leader only: they take no prefix
  hit, while its siblings still reuse its blocks; every choice shows the leader's scores.
* Usage (vLLM's rule): a prompt's tokens (and its cached tokens, the first candidate's) are
  counted once; completion tokens are those of the returned choices only.
* KV sharing: a family's first candidate (the leader) opens first; the others open only once the
  leader has its first token — its prompt's full blocks are then in stage 0's prefix cache — and
  on the leader's group, whatever the routing policy (Upstream.open's `prefer`; the retry rule
  still applies if that group fails).
* `open_all` runs openers together and, when one fails or it is cancelled, cancels the rest
  before raising, so no upstream call outlives a failed open.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine, Sequence
from typing import Any

from pipeserve.router.api.responses import ChoiceResult
from pipeserve.sampling_fields import MAX_SEED
from pipeserve.sampling_params import SamplingParams


def candidate_params(params: SamplingParams, j: int, best_of: int, n: int) -> SamplingParams:
    """Candidate j's sampling: seed + j; logprobs 0 where best_of ranks candidates the client
    did not ask logprobs for."""
    changes: dict[str, Any] = {}
    if params.seed is not None and j:
        changes["seed"] = (params.seed + j) % (MAX_SEED + 1)
    if j and params.prompt_logprobs is not None:  # the leader scores the prompt; siblings keep the hit
        changes["prompt_logprobs"] = None
    if best_of > n and params.logprobs is None:
        changes["logprobs"] = 0
    return dataclasses.replace(params, **changes) if changes else params


def cumulative_logprob(r: ChoiceResult) -> float:
    return sum(t.logprob for t in r.tokens)


def select(families: Sequence[Sequence[ChoiceResult]], n: int) -> list[ChoiceResult]:
    """The returned results of every family (prompt order), indexed prompt × n + rank, with the
    prompt's usage on its first returned choice only."""
    out: list[ChoiceResult] = []
    for i, members in enumerate(families):
        leader = members[0]
        if len(members) > n:  # best_of: rank by cumulative logprob (stable: ties keep their order)
            kept = sorted(members, key=cumulative_logprob, reverse=True)[:n]
        else:
            kept = list(members)
        for rank, r in enumerate(kept):
            first = rank == 0
            out.append(
                dataclasses.replace(
                    r,
                    index=i * n + rank,
                    prompt_tokens=leader.prompt_tokens if first else 0,
                    cached_tokens=leader.cached_tokens if first else 0,
                )
            )
    return out


async def open_all(openers: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Run every opener; the first failure (or a cancellation) cancels the others, then raises."""
    if len(openers) <= 1:
        for o in openers:
            await o
        return
    tasks = [asyncio.ensure_future(o) for o in openers]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def open_family(members: Sequence[Any]) -> None:
    """The leader first; its siblings once it has its first token, on its group."""
    leader, siblings = members[0], members[1:]
    await leader.open()
    await open_all([m.open(prefer=leader.group) for m in siblings])
    for m in siblings:  # the prompt side is the leader's (siblings do not score the prompt)
        m.result.prompt_scores = leader.result.prompt_scores
