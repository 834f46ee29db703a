"""The fault suite's mixed load and what transformers answers to each request of it.

Requests cycle through: a greedy completion (whole), one streamed, a response_format json_schema
(whole, then streamed: transformers' greedy generate with xgrammar's own HF logits processor over
the grammar the stage compiles: the router's parse of the body says which, compact or not), and
n = 2 (every choice is the greedy ids; streamed every other time). Prompts are random token ids,
long enough that most fill a KV block (16 tokens): their pages reach L3.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from checker import Case

from conftest import hf_constrained_greedy, hf_greedy, random_prompts
from pipeserve.router.features.structured import parse_structured

MAX_TOKENS = 6
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


@cache
def constrained_greedy(path: Path, prompt: tuple[int, ...], body_json: str, max_tokens: int) -> list[int]:
    """transformers' greedy ids under the request's json_schema, as the router hands it to stage 0."""
    spec = parse_structured(json.loads(body_json))
    assert spec is not None and spec.kind == "json", spec
    return hf_constrained_greedy(path, list(prompt), "json", spec.text, spec.compact, max_tokens)


def cases(model_dir: Path, n: int, seed: int, lo: int = 10, hi: int = 40) -> list[Case]:
    """n requests of the mixed load (see the module doc), prompts of lo..hi tokens."""
    out = []
    for i, p in enumerate(random_prompts(n, lo, hi, 1000, seed)):
        kind, stream = (i % 6) // 2, i % 2 == 1  # 0 greedy, 1 json_schema, 2 n=2; whole then streamed
        if kind == 1:
            case = Case(p, [], stream, MAX_TOKENS, schema=SCHEMA)
            body = json.dumps(case.body(str(model_dir)))
            case.want = constrained_greedy(model_dir, tuple(p), body, MAX_TOKENS)
        else:
            case = Case(p, hf_greedy(model_dir, p, MAX_TOKENS), stream, MAX_TOKENS, n=2 if kind == 2 else 1)
        out.append(case)
    return out
