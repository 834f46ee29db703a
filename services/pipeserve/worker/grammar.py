"""Structured outputs, the executing side: the last stage's xgrammar matchers (GrammarRows).

`GrammarRows` holds one GrammarMatcher per constrained request, built at every admission by
replaying the request's output tokens the NewRequest carries (so it survives preemption and group
restarts: never trusted from memory across admissions), and dropped when the plan frees the
request. Before sampling, it masks only the constrained rows; after sampling it advances each
matcher. A token the matcher rejects (or a replay that does not match the grammar) fails that
request only. When a grammar terminates, the token is marked `grammar_end` and stage 0 finishes
the request ("stop"), even with ignore_eos. Specs compile through engine/grammar.py's GrammarBook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeserve.engine.grammar import GrammarBook
from pipeserve.errors import InvalidRequestError


@dataclass
class _Row:
    matcher: Any
    outputs: list[int]  # the output tokens the matcher accepted, in order
    failed: str | None = None


class GrammarRows:
    """The last stage's matchers: admission, mask, advance, free."""

    def __init__(self, book: GrammarBook) -> None:
        self.book = book
        book.holds_matchers = True  # a pool compiling for this book must hand back the grammar itself
        self.rows: dict[str, _Row] = {}
        self._bitmask: torch.Tensor | None = None

    def admit(self, req_id: str, kind: str, text: str, compact: bool, outputs: list[int]) -> None:
        """(Re)build the request's matcher from scratch and replay its output tokens."""
        import xgrammar as xgr

        self.rows.pop(req_id, None)
        try:
            compiled = self.book.compile(kind, text, compact)
        except InvalidRequestError as e:
            self.rows[req_id] = _Row(None, [], f"grammar: {e.message}")
            return
        row = _Row(xgr.GrammarMatcher(compiled), [])
        for t in outputs:
            if row.matcher.is_terminated() or not row.matcher.accept_token(t):
                row.failed = f"grammar: replayed output token {t} is not accepted"
                break
            row.outputs.append(t)
        self.rows[req_id] = row

    def drop(self, req_id: str) -> None:
        self.rows.pop(req_id, None)

    def constrained(self, req_ids: list[str]) -> list[int]:
        return [i for i, r in enumerate(req_ids) if r in self.rows]

    def mask(self, logits: torch.Tensor, req_ids: list[str], sample_indices: list[int]) -> dict[str, str]:
        """Mask the constrained rows of `logits` [R, V] in place; returns failures {req_id: reason}."""
        import xgrammar as xgr

        rows = self.constrained(req_ids)
        failures: dict[str, str] = {}
        if not rows:
            return failures
        vocab = logits.shape[-1]
        n = len(rows)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 8), vocab)
        bitmask = self._bitmask[:n]
        live: list[int] = []
        for j, i in enumerate(rows):
            row = self.rows[req_ids[i]]
            if row.failed is None and len(row.outputs) != sample_indices[i]:
                row.failed = (
                    f"grammar: matcher holds {len(row.outputs)} tokens, step samples #{sample_indices[i]}"
                )
            if row.failed is not None:
                failures[req_ids[i]] = row.failed
                continue
            if row.matcher.is_terminated():  # the grammar ended and the request goes on: refuse
                failures[req_ids[i]] = "grammar: sampling after the grammar ended"
                continue
            row.matcher.fill_next_token_bitmask(bitmask, j)
            live.append(j)
        if live:
            sub = logits[rows].float()
            xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device), vocab_size=vocab)
            logits[rows] = sub.to(logits.dtype)
        return failures

    def advance(self, req_id: str, token: int) -> tuple[bool, str | None]:
        """Accept the sampled token: (grammar ended, failure reason or None)."""
        row = self.rows.get(req_id)
        if row is None:
            return False, None
        if not row.matcher.accept_token(token):
            row.failed = f"grammar: sampled token {token} is not accepted"
            return False, row.failed
        row.outputs.append(token)
        return row.matcher.is_terminated(), None
