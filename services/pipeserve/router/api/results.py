"""What a stream collects for each choice (`ChoiceResult`, `TokenLP`), and a fan-out folded back.

Filled by router/upstream/serving.py as the tokens arrive (the stream step of the router's way) and
read by the Formatter (router/api/responses.py). `select` folds a prompt's n / best_of candidates
back into the choices returned (router/upstream/fanout.py states the contract): best_of ranks them
by cumulative logprob, indexes are prompt x n + rank, and a prompt's tokens are counted once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenLP:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    offset: int  # characters of the choice's text before this token


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    finish_reason: str | None = None
    tokens: list[TokenLP] = field(default_factory=list)  # filled only when logprobs were asked
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # generated ids, up to a stop string's token
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""  # echo: the text that comes first
    prompt_scores: list = field(
        default_factory=list
    )  # prompt_logprobs: (logprob, rank, top) of positions 1..


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
