"""Benchmark workloads: prompts as token-id lists plus an output length per request.

Prompts are random token ids, so no tokenizer is needed and the server's prompt length is
exactly what we sent. (A request may carry text instead — `BenchRequest.text`, what
bench/prompts.py makes for a side-by-side — and then `prompt` holds the bench tokenizer's ids.)
Lengths follow SGLang's random dataset: each request's input and
output length is drawn uniformly from [len * (1 - range_ratio), len]. Every draw comes
from numpy Generators seeded by `--seed`, so a workload is reproducible run to run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Ids below this are special tokens in the demo model (EOS, <|im_start|>, <|im_end|>);
# a random prompt full of EOS or chat markers would not be a typical prompt.
DEFAULT_MIN_TOKEN_ID = 3
DEFAULT_VOCAB_SIZE = 256


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    # Sent instead of `prompt` when set, so the server tokenizes it; `prompt` is then its ids under
    # the bench's tokenizer (the server's own count comes back in the usage chunk).
    text: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def resolve_vocab_size(vocab_size: int | None, tokenizer_dir: str | None) -> int:
    """--vocab-size, else `vocab_size` from the model directory's config.json, else 256."""
    if vocab_size is not None:
        return vocab_size
    if tokenizer_dir:
        config = Path(tokenizer_dir) / "config.json"
        try:
            return int(json.loads(config.read_text())["vocab_size"])
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"--tokenizer: cannot read vocab_size from {config}: {e}") from e
    return DEFAULT_VOCAB_SIZE


def draw_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> np.ndarray:
    """n lengths uniform in [length * (1 - range_ratio), length], never below 1."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    return rng.integers(low, length + 1, size=n)


def _token_ids(rng: np.random.Generator, n: int, low: int, vocab: int) -> list[int]:
    return rng.integers(low, vocab, size=n).tolist()


def _check_vocab(low: int, vocab: int) -> None:
    if not 0 <= low < vocab:
        raise ValueError(f"token ids must come from a non-empty range [{low}, {vocab})")


def random_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    min_token_id: int = DEFAULT_MIN_TOKEN_ID,
) -> list[BenchRequest]:
    _check_vocab(min_token_id, vocab_size)
    rng = np.random.default_rng(seed)
    return _draw_requests(rng, num_requests, input_len, output_len, range_ratio, min_token_id, vocab_size)


def _draw_requests(
    rng: np.random.Generator,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    min_token_id: int,
    vocab_size: int,
) -> list[BenchRequest]:
    """Random prompts of drawn input lengths with drawn output lengths (lengths first, then ids)."""
    in_lens = draw_lengths(rng, input_len, range_ratio, num_requests)
    out_lens = draw_lengths(rng, output_len, range_ratio, num_requests)
    return [
        BenchRequest(_token_ids(rng, int(n_in), min_token_id, vocab_size), int(n_out))
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


def shared_prefix_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    shared_prefix_len: int,
    num_prefixes: int,
    min_token_id: int = DEFAULT_MIN_TOKEN_ID,
) -> list[BenchRequest]:
    """Request k = prefix[k % num_prefixes] + a random suffix of the drawn input length.

    Requests sharing a prefix exercise the prefix cache and prefix-affinity routing; the
    suffix keeps every prompt distinct, so whole prompts are never cached.
    """
    _check_vocab(min_token_id, vocab_size)
    if num_prefixes < 1 or shared_prefix_len < 1:
        raise ValueError("--num-prefixes and --shared-prefix-len must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [_token_ids(rng, shared_prefix_len, min_token_id, vocab_size) for _ in range(num_prefixes)]
    suffixes = _draw_requests(rng, num_requests, input_len, output_len, range_ratio, min_token_id, vocab_size)
    return [BenchRequest(prefixes[k % num_prefixes] + r.prompt, r.output_len) for k, r in enumerate(suffixes)]


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at request_rate req/s.

    Exponential inter-arrival gaps as in SGLang; rate inf sends everything at t=0 (the
    concurrency limit then paces the run). A generator separate from the workload's keeps
    the prompts identical whatever the rate.
    """
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng([seed, 1])
    gaps = rng.exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0  # the first request goes at once, so duration measures the server, not a wait
    return np.cumsum(gaps).tolist()


@dataclass(frozen=True)
class Conversation:
    """One multi-turn conversation: the shared system prompt, then per turn a user part and an output length.

    Turn t's prompt is `system + user[0] + out[0] + ... + user[t-1] + out[t-1] + user[t]`, where out[k]
    is what the server generated at turn k (`turn_prompt`); `fallback_outputs[k]` (random ids of length
    output_lens[k]) stands in for it when a server does not return generated token ids.
    """

    system: list[int]
    user: list[list[int]]
    output_lens: list[int]
    fallback_outputs: list[list[int]]

    @property
    def num_turns(self) -> int:
        return len(self.user)

    def turn_prompt(self, turn: int, outputs: list[list[int]]) -> list[int]:
        if not 0 <= turn < self.num_turns:
            raise ValueError(f"turn {turn} out of range [0, {self.num_turns})")
        if len(outputs) < turn:
            raise ValueError(f"turn {turn} needs the outputs of the {turn} turns before it")
        prompt = list(self.system)
        for k in range(turn):
            prompt += self.user[k] + outputs[k]
        return prompt + self.user[turn]

    def request(self, turn: int, outputs: list[list[int]]) -> BenchRequest:
        return BenchRequest(self.turn_prompt(turn, outputs), self.output_lens[turn])


def multi_turn_workload(
    num_conversations: int,
    num_turns: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    shared_prefix_len: int,
    min_token_id: int = DEFAULT_MIN_TOKEN_ID,
) -> list[Conversation]:
    """Conversations sharing one system prompt of `shared_prefix_len` ids, each `num_turns` turns long.

    Every user part and output length is drawn as in `random_workload`; the system prompt is drawn
    first, then each conversation in order, so conversation k is the same whatever num_conversations.
    """
    _check_vocab(min_token_id, vocab_size)
    if num_conversations < 1 or num_turns < 1:
        raise ValueError("--num-conversations and --num-turns must be >= 1")
    if shared_prefix_len < 0:
        raise ValueError("--shared-prefix-len must be >= 0")
    rng = np.random.default_rng([seed, 2])
    system = _token_ids(rng, shared_prefix_len, min_token_id, vocab_size)
    conversations = []
    for _ in range(num_conversations):
        turns = _draw_requests(rng, num_turns, input_len, output_len, range_ratio, min_token_id, vocab_size)
        outs = [_token_ids(rng, t.output_len, min_token_id, vocab_size) for t in turns]
        conversations.append(
            Conversation(system, [t.prompt for t in turns], [t.output_len for t in turns], outs)
        )
    return conversations
