"""Structured outputs, the deciding side: which specs exist and whether one compiles (xgrammar).

A constrained request carries `(structured_kind, structured, structured_compact)` in its
SamplingParams / SamplingSpec (the router normalizes every API spelling to them):
* "json"        structured = a JSON Schema (text)
* "json_object" any JSON object (structured is empty)
* "regex"       structured = a regular expression
* "choice"      structured = a JSON list of strings: the output is one of them, verbatim
* "grammar"     structured = an EBNF grammar (xgrammar's GBNF dialect, `root` rule)
`structured_compact` compiles JSON without free whitespace (vLLM's `disable_any_whitespace`; the
router sets it for forced tool calls); without it, JSON may hold whitespace between elements, at
most JSON_MAX_WHITESPACE characters in a row (pretty-printed to a depth of 3, not a budget spent
on spaces: vLLM's default is unbounded).

Contract: `GrammarBook.compile` is deterministic and cached (bounded LRU keyed by the spec). Stage 0
compiles before admission in a pool of killable worker processes (engine/grammar_pool.py: a queue
deadline, `COMPILE_DEADLINE_S` of compile time, nothing left running after the answer), whose
result lands in the book (`put_json`, or `mark_valid` where this process holds no matcher);
LLMEngine's `validate` then finds it. A spec that does not compile is an InvalidRequestError on
`structured` — before any KV. The last stage's matchers (worker/grammar.py) compile through a book
too (`compile_spec`, the one compile function, also the pool workers'), so every side agrees on
what a spec means. `prepare` builds the tokenizer's grammar info once (start-up: a first compile
would otherwise pay ~5 s of imports and tokenizer loading). xgrammar (which imports torch) is
imported only here and in the workers; the router never imports this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pipeserve.errors import InvalidRequestError

log = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPILE_DEADLINE_S = 10.0
CACHE_SIZE = 128
JSON_MAX_WHITESPACE = 8  # characters between two JSON elements, unless compact (none)
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
VALID_SIZE = 4096  # specs known to compile (a key is their text: bounded memory)

Key = tuple[str, str, bool]


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM's escaping for xgrammar)."""
    lits = ['"' + c.replace("\\", "\\\\").replace('"', '\\"') + '"' for c in choices]
    return "root ::= " + " | ".join(lits)


def _digest(key: Key) -> bytes:
    return hashlib.sha256(json.dumps(key).encode("utf-8", "surrogatepass")).digest()


def compile_spec(compiler: Any, kind: str, text: str, compact: bool) -> Any:
    """One spec's CompiledGrammar; raises InvalidRequestError("structured", why). `compact`: JSON
    without free whitespace (xgrammar's any_whitespace=False, vLLM's disable_any_whitespace)."""
    # JSON's whitespace: none when compact, else any whitespace but at most JSON_MAX_WHITESPACE
    # characters between two elements (a model cannot spend its max_tokens on spaces).
    ws: dict[str, Any] = (
        {"any_whitespace": False}
        if compact
        else {"any_whitespace": True, "max_whitespace_cnt": JSON_MAX_WHITESPACE}
    )
    try:
        if kind == "json":
            return compiler.compile_json_schema(text, strict_mode=True, **ws)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', **ws)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(text)))
        if kind == "grammar":
            return compiler.compile_grammar(text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the parser's message
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        msg = _SOURCE_PREFIX.sub("", msg)  # "[06:32:40] /project/cpp/x.cc:94: " names xgrammar's source
        raise InvalidRequestError("structured", f"the {kind} does not compile: {msg[:300]}") from None
    raise InvalidRequestError("structured", f"unknown kind {kind!r}")


def new_compiler(info: Any) -> Any:
    import xgrammar as xgr

    # One thread: the same schema compiles the same way everywhere.
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


class GrammarBook:
    """Compiles structured specs for one checkpoint's tokenizer; bounded LRU, thread-safe."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._info: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Key, Any] = OrderedDict()
        # Specs a pool worker compiled, for a book whose process holds no matcher (stage 0 of
        # several): admission needs to know they compile, not their grammar.
        self._valid: OrderedDict[bytes, None] = OrderedDict()  # by digest: a spec is up to 256 KiB
        self.holds_matchers = False  # set by the last stage's GrammarRows: it needs compiled grammars
        self.compiles = 0  # cache misses, for tests

    def prepare(self) -> None:
        """Build the tokenizer's grammar info and the compiler now (start-up), not at the first
        structured request; raises what reading the tokenizer raises."""
        with self._lock:
            if self._compiler is not None:
                return
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_dir)
            self._info = xgr.TokenizerInfo.from_huggingface(
                tok, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
            )
            self._compiler = new_compiler(self._info)

    def warm(self) -> None:
        """`prepare`, at start-up: a tokenizer xgrammar cannot read is a warning here (structured
        requests then say why), not a stage that does not start."""
        try:
            self.prepare()
        except Exception as e:  # noqa: BLE001 - any reader error: told per request by `compile`
            log.warning("structured outputs unavailable: %s: %s", type(e).__name__, e)

    def tokenizer_info_json(self) -> str:
        """The tokenizer's grammar info as xgrammar's JSON (what a pool worker starts from)."""
        self.prepare()
        return str(self._info.serialize_json())

    def _get_compiler(self) -> Any:
        self.prepare()
        return self._compiler

    def has(self, kind: str, text: str, compact: bool) -> bool:
        key = (kind, text, compact)
        with self._lock:
            return key in self._cache or _digest(key) in self._valid

    def _store(self, key: Key, compiled: Any) -> None:
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)

    def put_json(self, kind: str, text: str, compact: bool, grammar_json: str) -> None:
        """Cache a grammar a pool worker compiled (xgrammar's JSON: no pickle crosses processes)."""
        import xgrammar as xgr

        self.prepare()
        self._store((kind, text, compact), xgr.CompiledGrammar.deserialize_json(grammar_json, self._info))

    def mark_valid(self, kind: str, text: str, compact: bool) -> None:
        """A pool worker compiled this spec: `check` passes without compiling it here."""
        d = _digest((kind, text, compact))
        with self._lock:
            self._valid[d] = None
            self._valid.move_to_end(d)
            while len(self._valid) > VALID_SIZE:
                self._valid.popitem(last=False)

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
        self._store(key, compiled)
        return compiled

    def _compile(self, kind: str, text: str, compact: bool) -> Any:
        try:
            compiler = self._get_compiler()
        except Exception as e:  # noqa: BLE001 - no tokenizer in the checkpoint, or one xgrammar cannot read
            raise InvalidRequestError(
                "structured", f"structured outputs need the checkpoint's tokenizer: {type(e).__name__}"
            ) from None
        return compile_spec(compiler, kind, text, compact)

    def check(self, kind: str, text: str, compact: bool) -> None:
        if not kind:
            return
        with self._lock:
            if _digest((kind, text, compact)) in self._valid:
                return
        self.compile(kind, text, compact)
