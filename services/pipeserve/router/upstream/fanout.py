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
  before raising, so no upstream call outlives a failed open (those already open the caller
  closes: router/http/handlers.py).
* The plan step of the router's way: `plan` turns the prompts into families of `Planned` calls;
  `open_family` hands each to the opener the conductor gives (pick a group, then stream), so the
  fan-out never calls back into a step before it. The fold back is `select`
  (router/api/results.py, with what the streams collected).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pipeserve.router.api.results import cumulative_logprob, select
from pipeserve.sampling_fields import MAX_SEED
from pipeserve.sampling_params import SamplingParams

__all__ = ["Planned", "candidate_params", "cumulative_logprob", "open_all", "open_family", "plan", "select"]
T = TypeVar("T")


@dataclass
class Planned:
    """One Generate call of the fan-out: returned choice `index`, its prompt, sampling and request id."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    counts_prompt: bool = True  # False for an n > 1 sibling: its prompt is counted once
    prompt_text: str = ""  # echo: the prompt side of the choice (router/features/echo.py)
    drop_output: bool = False  # echo with max_tokens 0: the one token asked is not returned


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


def plan(
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    n: int,
    best_of: int,
    rid: str,
    echoed: Sequence[str] | None = None,
    drop_output: bool = False,
) -> list[list[Planned]]:
    """Per prompt, its best_of candidates, leader first; only `<rid>-<i>` when best_of = 1."""
    families = []
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        text = echoed[i] if echoed is not None else ""
        if best_of == 1:
            families.append([Planned(i, ids, p, f"{rid}-{i}", True, text, drop_output)])
            continue
        candidates = [candidate_params(p, j, best_of, n) for j in range(best_of)]
        families.append(
            [
                Planned(i * n + j, ids, cp, f"{rid}-{i}-{j}", j == 0, text, drop_output)
                for j, cp in enumerate(candidates)
            ]
        )
    return families


async def open_all(openers: Sequence[Awaitable[T]]) -> list[T]:
    """Run every opener; the first failure (or a cancellation) cancels the others, then raises.
    Their results, in order."""
    if len(openers) <= 1:
        return [await o for o in openers]
    tasks = [asyncio.ensure_future(o) for o in openers]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def open_family(
    members: Sequence[Planned], open_one: Callable[[Planned, str | None], Awaitable[Any]]
) -> list:
    """The leader first; its siblings once it has its first token, on its group (`open_one(member,
    prefer)` picks a group, `prefer` first, and returns the opened choice)."""
    leader_member, siblings = members[0], members[1:]
    leader = await open_one(leader_member, None)
    opened = await open_all([open_one(m, leader.group) for m in siblings]) if siblings else []
    for c in opened:  # the prompt side is the leader's (siblings do not score the prompt)
        c.result.prompt_scores = leader.result.prompt_scores
    return [leader, *opened]
