"""Structured outputs on the stages: compiled grammars (stage 0 and the last stage) and matchers
(the last stage), with xgrammar.

A constrained request carries `(structured_kind, structured, structured_compact)` in its
SamplingParams / SamplingSpec (the router normalizes every API spelling to them):
* "json"        structured = a JSON Schema (text)
* "json_object" any JSON object (structured is empty)
* "regex"       structured = a regular expression
* "choice"      structured = a JSON list of strings: the output is one of them, verbatim
* "grammar"     structured = an EBNF grammar (xgrammar's GBNF dialect, `root` rule)
`structured_compact` compiles JSON without free whitespace (vLLM's `disable_any_whitespace`).

Contract:
* `GrammarBook.compile` is deterministic and cached (bounded LRU keyed by the spec). Stage 0
  compiles before admission (stage/server.py, off the event loop, `COMPILE_DEADLINE_S`); a
  spec that does not compile is an InvalidRequestError on `structured` — before any KV.
* `GrammarRows` (last stage) holds one GrammarMatcher per constrained request, built at every
  admission by replaying the request's output tokens the NewRequest carries (so it survives
  preemption and group restarts: never trusted from memory across admissions), and dropped
  when the plan frees the request. Before sampling, it masks only the constrained rows; after
  sampling it advances each matcher. A token the matcher rejects (or a replay that does not
  match the grammar) fails that request only. When a grammar terminates, the token is marked
  `grammar_end` and stage 0 finishes the request ("stop"), even with ignore_eos.
xgrammar imports torch: the router never imports this module.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeserve.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPILE_DEADLINE_S = 10.0
CACHE_SIZE = 128

Key = tuple[str, str, bool]


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM's escaping for xgrammar)."""
    lits = ['"' + c.replace("\\", "\\\\").replace('"', '\\"') + '"' for c in choices]
    return "root ::= " + " | ".join(lits)


class GrammarBook:
    """Compiles structured specs for one checkpoint's tokenizer; bounded LRU, thread-safe."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Key, Any] = OrderedDict()
        self.compiles = 0  # cache misses, for tests

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
                )
                # One thread: the same schema compiles the same way everywhere.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, kind: str, text: str, compact: bool = False) -> Any:
        """The CompiledGrammar of a spec; raises InvalidRequestError("structured", why)."""
        key = (kind, text, compact)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(kind, text, compact)
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str, compact: bool) -> Any:
        try:
            compiler = self._get_compiler()
        except Exception as e:  # noqa: BLE001 - no tokenizer in the checkpoint, or one xgrammar cannot read
            raise InvalidRequestError(
                "structured", f"structured outputs need the checkpoint's tokenizer: {type(e).__name__}"
            ) from None
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=not compact, strict_mode=True)
            if kind == "json_object":
                if compact:
                    return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                return compiler.compile_json_schema('{"type": "object"}')
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(text)))
            if kind == "grammar":
                return compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the parser's message
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError("structured", f"the {kind} does not compile: {msg[:300]}") from None
        raise InvalidRequestError("structured", f"unknown kind {kind!r}")

    def check(self, kind: str, text: str, compact: bool) -> None:
        if kind:
            self.compile(kind, text, compact)


@dataclass
class _Row:
    matcher: Any
    outputs: list[int]  # the output tokens the matcher accepted, in order
    failed: str | None = None


class GrammarRows:
    """The last stage's matchers: admission, mask, advance, free."""

    def __init__(self, book: GrammarBook) -> None:
        self.book = book
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
