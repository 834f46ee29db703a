"""JSON's whitespace policy (engine/grammar.py): a model cannot spend its max_tokens on spaces.

Compact (forced tool calls, `disable_any_whitespace`): no free whitespace (fixed separators).
Otherwise (response_format, guided_json): any whitespace, but at most JSON_MAX_WHITESPACE
characters between two elements — pretty-printing fits, a run of spaces does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeserve.engine.grammar import JSON_MAX_WHITESPACE, GrammarBook
from pipeserve.model.config import ModelConfig

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.fixture(scope="module")
def book(llama_dir: Path) -> GrammarBook:
    cfg = ModelConfig.from_dir(llama_dir)
    return GrammarBook(llama_dir, cfg.vocab_size, cfg.eos_token_ids)


def _accepts(book: GrammarBook, kind: str, compact: bool, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(book.compile(kind, SCHEMA if kind == "json" else "", compact))
    return bool(matcher.accept_string(text))


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_json_whitespace_is_bounded_and_compact_has_none(book: GrammarBook, kind: str) -> None:
    pretty = '{\n    "a": 1\n}'
    spaced = "{" + " " * (JSON_MAX_WHITESPACE + 1) + '"a": 1}'
    assert _accepts(book, kind, False, '{"a": 1}') and _accepts(book, kind, False, pretty)
    assert not _accepts(book, kind, False, spaced)
    # Compact is xgrammar's fixed separators (", ", ": "), as vLLM's disable_any_whitespace: no choice.
    assert _accepts(book, kind, True, '{"a": 1}')
    assert not _accepts(book, kind, True, '{ "a": 1}') and not _accepts(book, kind, True, '{"a":  1}')
