"""Fresh prompts for a side-by-side: no prompt of a run shares a prefix with one a server may hold.

Why: both servers keep what they computed. llama-server's slots keep their last prompt and reuse its
longest common token prefix with the next one (`-np 16`: sixteen prompts held at once; its RAM cache
restores an older one only when a quarter of it matches); pipeserve's prefix cache matches whole KV
blocks. A benchmark whose prompts share a leading template, or that re-sends a prompt, times a cache.

Contract of `FreshPrompts`:
  - every prompt's first token differs from that of each of the `reuse_distance` prompts before it
    (first tokens rotate through a shuffled pool, least recently used first), so its common prefix
    with anything a server still holds is empty — `reuse_distance` is checked against the most
    prompts a server can hold (`check_distance`);
  - no two prompts of a run share their leading three words (or ids);
  - `requests(key, ...)` is memoized by key: the pass of each server for one cell and round gets the
    same prompts (each server still sees each prompt once), and every other key gets new ones;
  - text prompts (`TextPrompts`) are random words of the corpus that trained the demo tokenizer
    (`pipeserve/model/corpus.txt`, shipped with the package), sized with the served model's own
    tokenizer to the target count (exactly, within `tolerance` at worst) and sent as text, so each
    server tokenizes them; token-id prompts (`IdPrompts`) are random ids, sent as ids.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Protocol

import numpy as np

from pipeserve.bench.workloads import DEFAULT_MIN_TOKEN_ID, BenchRequest

LEAD_WORDS = 3  # the leading sequence no two prompts of a run share
MIN_POOL = 1024  # first tokens wanted; words first, then single-token fragments of the vocabulary
PROBE = " the"  # what follows a lead when checking that it keeps its first token in context


def corpus_words() -> list[str]:
    """The distinct lower-case words of the corpus the demo tokenizer is trained on (sorted)."""
    text = resources.files("pipeserve.model").joinpath("corpus.txt").read_text("utf-8")
    return sorted({w.lower() for w in re.findall(r"[A-Za-z]+", text)})


def tolerance(n: int) -> int:
    """How far a text prompt's token count may miss its target: 2 tokens or 2 %."""
    return max(2, n // 50)


class Maker(Protocol):
    """Builds one prompt of `n` tokens whose first token is `first` (a member of `first_tokens`)."""

    kind: str

    def first_tokens(self) -> list[int]: ...

    def build(self, rng: np.random.Generator, first: int, n: int, output_len: int) -> BenchRequest: ...

    def leading(self, req: BenchRequest) -> tuple: ...


class IdPrompts:
    """Random token ids from [min_id, vocab); any id may lead."""

    kind = "ids"

    def __init__(self, vocab: int, min_id: int = DEFAULT_MIN_TOKEN_ID) -> None:
        if not 0 <= min_id < vocab:
            raise ValueError(f"token ids must come from a non-empty range [{min_id}, {vocab})")
        self.vocab, self.min_id = vocab, min_id

    def first_tokens(self) -> list[int]:
        return list(range(self.min_id, self.vocab))

    def build(self, rng: np.random.Generator, first: int, n: int, output_len: int) -> BenchRequest:
        rest = rng.integers(self.min_id, self.vocab, size=max(0, n - 1)).tolist()
        return BenchRequest([first, *rest], output_len)

    def leading(self, req: BenchRequest) -> tuple:
        return tuple(req.prompt[:LEAD_WORDS])


class TextPrompts:
    """Random corpus words sized with `encode` (the served model's tokenizer, specials included).

    Token counts add up word by word: the tokenizers served here (byte-level BPE, GPT-2's split)
    pre-split text at each " word", so a prompt's count is its specials' plus its lead's plus each
    " word"'s. `build` fills the target with words and closes the last gap with a word of exactly the
    tokens left, then tokenizes the whole text to check.
    """

    kind = "text"

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        decode: Callable[[int], str] | None = None,
        vocab: int = 0,
        words: Sequence[str] | None = None,
    ) -> None:
        self.encode = encode
        self.specials = len(encode(""))  # a BOS the tokenizer adds: shared by all, never a lead
        words = list(words or corpus_words())
        counts = {w: len(encode(" " + w)) - self.specials for w in words}
        self.words = np.array(words)
        self.counts = np.array([counts[w] for w in words])
        self.by_count: dict[int, np.ndarray] = {c: self.words[self.counts == c] for c in set(counts.values())}
        self.leads: dict[int, list[str]] = {}
        for w in words:
            for form in (w, w.capitalize(), w.upper()):
                self._add_lead(form)
        if len(self.leads) < MIN_POOL and decode is not None:
            # Few words start with distinct tokens (a small vocabulary): single-token fragments of
            # letters lead too, so first tokens still rotate through a long pool.
            for tid in range(vocab):
                piece = decode(tid)
                if piece.isascii() and piece.isalpha() and encode(piece)[self.specials :] == [tid]:
                    self._add_lead(piece)
        if not self.leads:
            raise ValueError("no word of the corpus keeps its first token in context")

    def _add_lead(self, form: str) -> None:
        ids = self.encode(form + PROBE)[self.specials :]
        if ids and ids[0] not in self.leads:
            self.leads[ids[0]] = [form]
        elif ids and form not in self.leads[ids[0]]:
            self.leads[ids[0]].append(form)

    def first_tokens(self) -> list[int]:
        return sorted(self.leads)

    def build(self, rng: np.random.Generator, first: int, n: int, output_len: int) -> BenchRequest:
        forms = self.leads[first]
        lead = forms[int(rng.integers(len(forms)))]
        left = n - self.specials - (len(self.encode(lead)) - self.specials)
        picked: list[str] = []
        shortest = int(self.counts.min())
        while left >= shortest:
            # Draw a batch of words at a time (one draw per word is slow for 2k-token prompts).
            for i in rng.integers(len(self.words), size=max(8, left)):
                c = int(self.counts[i])
                if c <= left:
                    picked.append(str(self.words[i]))
                    left -= c
                elif left in self.by_count:  # close the gap exactly
                    exact = self.by_count[left]
                    picked.append(str(exact[int(rng.integers(len(exact)))]))
                    left = 0
                if left <= 0:
                    break
        text = lead + "".join(" " + w for w in picked)
        ids = self.encode(text)
        if abs(len(ids) - n) > tolerance(n) or ids[self.specials] != first:
            raise ValueError(f"a prompt sized for {n} tokens has {len(ids)}, first id {ids[self.specials]}")
        return BenchRequest(ids, output_len, text=text)

    def leading(self, req: BenchRequest) -> tuple:
        return tuple((req.text or "").split()[:LEAD_WORDS])


def hf_text_prompts(model_dir: str) -> TextPrompts:
    """TextPrompts over the model directory's tokenizer (transformers, imported only here)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return TextPrompts(lambda s: list(tok(s)["input_ids"]), lambda i: str(tok.decode([i])), vocab=len(tok))


class FreshPrompts:
    """Hands out prompt sets by key; see the module docstring for what stays fresh."""

    def __init__(self, maker: Maker, seed: int) -> None:
        self.maker, self.seed = maker, seed
        self.rng = np.random.default_rng([seed, 27])
        pool = maker.first_tokens()
        self.rng.shuffle(pool)
        self._pool: deque[int] = deque(pool)
        self._sets: dict[str, list[BenchRequest]] = {}
        self._leads: set[tuple] = set()
        self.issued = 0

    @property
    def reuse_distance(self) -> int:
        """Prompts issued between two that share a first token (the pool's size)."""
        return len(self._pool)

    def check_distance(self, held: int) -> None:
        """Raise unless a server holding `held` prompts (its slots, its batch) can hold no earlier
        prompt with a recycled first token: the pool must be longer than twice what it holds."""
        if self.reuse_distance <= 2 * held:
            raise ValueError(
                f"only {self.reuse_distance} distinct first tokens for a server holding {held} prompts: "
                "a prompt's first token could meet one still cached; use token-id prompts"
            )

    def _one(self, n: int, output_len: int) -> BenchRequest:
        first = self._pool.popleft()
        self._pool.append(first)  # least recently used first: reused only after the whole pool
        for _ in range(100):
            req = self.maker.build(self.rng, first, n, output_len)
            lead = self.maker.leading(req)
            if lead not in self._leads:
                self._leads.add(lead)
                self.issued += 1
                return req
        raise RuntimeError(f"no fresh leading sequence for first token {first} after 100 draws")

    def requests(self, key: str, n: int, prompt_len: int, output_len: int) -> list[BenchRequest]:
        """The prompt set `key` (n prompts of prompt_len tokens, output_len each); new keys get new ones."""
        got = self._sets.get(key)
        if got is not None:
            if (len(got), got[0].output_len) != (n, output_len):
                raise ValueError(f"prompt set {key!r} was made with other sizes")
            return got
        made = [self._one(prompt_len, output_len) for _ in range(n)]
        self._sets[key] = made
        return made
