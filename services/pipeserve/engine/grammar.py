"""Structured outputs, the deciding side: which specs exist and whether one compiles (xgrammar).

A constrained request carries `(structured_kind, structured, structured_compact)` in its
SamplingParams / SamplingSpec (the router normalizes every API spelling to them):
* "json"        structured = a JSON Schema (text)
* "json_object" any JSON object (structured is empty)
* "regex"       structured = a regular expression
* "choice"      structured = a JSON list of strings: the output is one of them, verbatim
* "grammar"     structured = an EBNF grammar (xgrammar's GBNF dialect, `root` rule)
`structured_compact` compiles JSON without free whitespace (vLLM's `disable_any_whitespace`).

Contract: `GrammarBook.compile` is deterministic and cached (bounded LRU keyed by the spec). Stage 0
compiles before admission (stage/server.py, off the event loop, `COMPILE_DEADLINE_S`; LLMEngine's
`validate`): a spec that does not compile is an InvalidRequestError on `structured` — before any
KV. The last stage's matchers (worker/grammar.py) compile through a book too, so both sides
agree on what a spec means. xgrammar (which imports torch) is imported only when compiling; the
router never imports this module (router/ imports no engine module).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

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
