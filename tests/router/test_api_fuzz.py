"""Property-based fuzz of both OpenAI endpoints against a live `pipeserve up --stages 2 --replicas 2`.

Every field is drawn absent, valid or hostile (extreme floats — tiny, huge,
subnormal, NaN/Infinity literals, "nan"/"inf" strings —, integers of hundreds of
digits, wrong types, empty and long lists, nesting, odd unicode and lone
surrogates). The law under test (DESIGN §2.5, §10.13): **no response >= 500,
no stage exits, no group restarts**, and a normal request is answered right
after. CI runs a fixed seed and a bounded number of examples;
`PIPESERVE_FUZZ_EXAMPLES=2000 make fuzz` runs longer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from serving_support import UpProcess, running_up

pytestmark = pytest.mark.slow
NAME = "fuzz"
EXAMPLES = int(os.environ.get("PIPESERVE_FUZZ_EXAMPLES", "120"))
VOCAB = 1024  # the demo model's vocabulary (DemoSpec default)

# The requests of death seen in the field: every one must be served, none may kill a stage.
DEATH_TEMPERATURES = [1e-40, 1e-38, 1e-300, 5e-324, 3.4e38, 1e300, 1.7976931348623157e308]


@pytest.fixture(scope="module")
def up(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    args = ("--model", str(llama_dir), "--served-model-name", NAME, "--stages", "2", "--replicas", "2")
    with running_up(
        *args, "--max-model-len", "128", "--num-kv-blocks", "256", log_dir=tmp_path_factory.mktemp("fuzz")
    ) as server:
        yield server


def _send(up: UpProcess, path: str, body: object) -> tuple[int, str]:
    """POST the body as JSON text (NaN/Infinity literals and lone surrogates included, escaped as
    JSON allows); a streamed 200 must end with [DONE]."""
    data = json.dumps(body, allow_nan=True)
    with httpx.stream(
        "POST", up.url + path, content=data, headers={"content-type": "application/json"}, timeout=120
    ) as r:
        text = r.read().decode("utf-8", "replace")
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]"), text[-500:]
    return r.status_code, text


def test_requests_of_death_are_served(up: UpProcess) -> None:
    pids = up.pids()
    for t in DEATH_TEMPERATURES:
        for path, body in (
            ("/v1/completions", {"prompt": "Hi there", "max_tokens": 4}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        ):
            status, text = _send(up, path, {**body, "model": NAME, "temperature": t, "top_p": 1e-9})
            assert status == 200, (t, text)
    up.assert_unharmed(pids, NAME)


# --- strategies --------------------------------------------------------------
ODD_TEXT = st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e\u200b", "🦀" * 20, "\ufffd", "é" * 300, ""])
TEXT = st.text(max_size=40) | ODD_TEXT
ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=10,
)
HUGE_INTS = st.sampled_from([10**30, -(10**30), 10**400, 2**63, 2**64, -(2**63) - 1])
FLOATS = (
    st.sampled_from([0.0, -0.0, 1e-40, 5e-324, 1e-300, 1e300, 1.7976931348623157e308, 0.5, 1.0, 2.0, 1e-5])
    | st.floats()
    | st.sampled_from(["nan", "inf", "-inf", "1.0", ""])
    | HUGE_INTS
    | st.integers(-5, 5)
)
INTS = st.integers(-3, 40) | HUGE_INTS | st.floats(0, 10) | st.sampled_from(["4", True, None])
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)
PROMPT = (
    TEXT
    | TOKEN_IDS
    | st.lists(TEXT | TOKEN_IDS, min_size=0, max_size=3)
    | st.lists(st.integers(), max_size=5)
    | ANY
)
STOP = st.none() | TEXT | st.lists(TEXT, max_size=5) | ANY
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | TEXT | ANY},
    optional={
        "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})) | ANY
    },
)
SCHEMA = (
    st.sampled_from(
        [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "string", "enum": ["x", "y"]},
            '{"type": "integer"}',
            {"type": "nonsense"},
            "{not json",
        ]
    )
    | ANY
)
SAMPLING = {
    "model": st.just(NAME) | TEXT | ANY,
    "max_tokens": INTS,
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS | st.just(-1),
    "min_p": FLOATS,
    "seed": INTS | HUGE_INTS,
    "stop": STOP,
    "stop_token_ids": st.lists(st.integers(-2, VOCAB + 2), max_size=4) | ANY,
    "ignore_eos": st.booleans() | ANY,
    "stream": st.booleans() | ANY,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | ANY}) | ANY,
    "n": INTS,
    "prompt_logprobs": INTS,
    "frequency_penalty": FLOATS,
    "presence_penalty": FLOATS,
    "repetition_penalty": FLOATS,
    "logit_bias": st.dictionaries(st.integers(-2, VOCAB + 2).map(str) | TEXT, FLOATS | ANY, max_size=4) | ANY,
    "min_tokens": INTS,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
    | st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": SCHEMA}),
        }
    )
    | ANY,
    # Structured outputs (router/features/structured.py): vLLM's guided_* and structured_outputs.
    "guided_json": SCHEMA,
    "guided_regex": st.sampled_from(["[a-z]{1,5}", "(", "a*", "\\d+"]) | ANY,
    "guided_choice": st.lists(TEXT, max_size=3) | ANY,
    "guided_grammar": st.sampled_from(['root ::= "a" | "b"', "root ::= ", "x"]) | ANY,
    "structured_outputs": st.fixed_dictionaries(
        {},
        optional={
            "json": SCHEMA,
            "regex": st.sampled_from(["[0-9]+", ")"]) | ANY,
            "choice": st.lists(TEXT, max_size=2) | ANY,
            "json_object": st.booleans() | ANY,
            "disable_any_whitespace": st.booleans() | ANY,
        },
    )
    | ANY,
    "return_token_ids": st.booleans() | ANY,
    "add_special_tokens": st.booleans() | ANY,
    "user": TEXT,
    "unknown_field": ANY | HUGE_INTS,
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": PROMPT},
    optional={
        **SAMPLING,
        "logprobs": INTS,
        "echo": st.booleans(),
        "best_of": INTS,
        "suffix": TEXT,
    },
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | ANY},
    optional={
        **SAMPLING,
        "max_completion_tokens": INTS,
        "logprobs": st.booleans() | ANY,
        "top_logprobs": INTS,
        "tools": ANY,
        "tool_choice": ANY,
    },
)
HOSTILE = FLOATS | INTS | ANY | TEXT | st.lists(st.integers(), max_size=3)
# Valid requests (short generations), then 0-2 fields replaced or added with hostile values:
# most draws then fail in exactly one field, the way a client's single mistake does.
OK_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
VALID = {
    "temperature": st.floats(0, 2) | st.sampled_from(DEATH_TEMPERATURES),
    "top_p": st.floats(0, 1, exclude_min=True) | st.just(1e-12),
    "top_k": st.integers(-1, 5000),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**63),
    "stop": st.lists(OK_TEXT, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "return_token_ids": st.booleans(),
    "n": st.integers(1, 4),
    "prompt_logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 2, exclude_min=True) | st.sampled_from([1e-30, 1e30, 1e300]),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=5),
    "min_tokens": st.integers(0, 8),
}
VALID_COMPLETION = st.fixed_dictionaries(
    {"model": st.just(NAME), "prompt": OK_TEXT | TOKEN_IDS, "max_tokens": st.integers(1, 8)},
    optional={**VALID, "logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.integers(1, 6)},
)
VALID_CHAT = st.fixed_dictionaries(
    {
        "model": st.just(NAME),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": OK_TEXT}),
            min_size=1,
            max_size=2,
        ),
        "max_tokens": st.integers(1, 8),
    },
    optional={**VALID, "logprobs": st.booleans()},
)


def _mutated(valid: st.SearchStrategy, fields: list[str]) -> st.SearchStrategy:
    edits = st.lists(st.tuples(st.sampled_from(fields), HOSTILE), max_size=2)
    return st.builds(lambda body, changes: {**body, **dict(changes)}, valid, edits)


COMPLETION_FIELDS = ["prompt", *SAMPLING, "logprobs", "echo", "best_of", "suffix"]
CHAT_FIELDS = ["messages", *SAMPLING, "max_completion_tokens", "logprobs", "top_logprobs", "tools"]
REQUEST = (
    st.tuples(st.just("/v1/completions"), _mutated(VALID_COMPLETION, COMPLETION_FIELDS))
    | st.tuples(st.just("/v1/chat/completions"), _mutated(VALID_CHAT, CHAT_FIELDS))
    | st.tuples(st.just("/v1/completions"), _mutated(VALID_COMPLETION, COMPLETION_FIELDS))
    | st.tuples(st.just("/v1/chat/completions"), _mutated(VALID_CHAT, CHAT_FIELDS))
    | st.tuples(st.just("/v1/completions"), COMPLETION | ANY)
    | st.tuples(st.just("/v1/chat/completions"), CHAT | ANY)
)


def test_fuzz_both_endpoints_no_5xx_no_exits_no_restarts(up: UpProcess) -> None:
    pids = up.pids()
    seen: dict[int, int] = {}

    @seed(20261203)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(REQUEST)
    def one(request: tuple[str, object]) -> None:
        path, body = request
        status, text = _send(up, path, body)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (path, body, status, text[:500])

    one()
    print("statuses:", dict(sorted(seen.items())))
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0, seen
    up.assert_unharmed(pids, NAME)
