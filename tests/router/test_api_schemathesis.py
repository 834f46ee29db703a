"""schemathesis fuzzes both OpenAI endpoints from the router's own /openapi.json, live.

A `pipeserve up --stages 2 --replicas 2` on the demo model serves the
document (router/api/openapi.py); schemathesis generates request bodies for
`POST /v1/completions` and `POST /v1/chat/completions` from it, with a fixed
seed and a bounded number of examples. The laws (DESIGN §2.5):
* no response >= 500, whatever the body (schemathesis' not_a_server_error);
* a body valid by the schema is served (200) unless only the deployment can
  refuse it (the document says so in words: context length, vocabulary, an
  empty tokenization) — any other 4xx means the schema or the parser is wrong;
  its 200 responses match the documented response schema;
* afterwards no stage process was replaced, no group restarted, and a normal
  request is answered.
`PIPESERVE_SCHEMATHESIS_EXAMPLES` raises the example count for a longer run.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from serving_support import UpProcess, running_up

pytestmark = pytest.mark.slow
NAME = "schemathesis"
EXAMPLES = int(os.environ.get("PIPESERVE_SCHEMATHESIS_EXAMPLES", "120"))
SEED = 20261203
POSITIVE_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

# 400s a schema-valid body may still get: limits of this deployment, named in the document's words.
DEPLOYMENT_LIMITS = (
    "maximum context length",
    "outside the vocabulary",
    "the prompt is empty",
    "is too large",
    "--tool-call-parser",  # tool_choice auto (the default with tools) on a server without a parser
    "chat template failed",  # a chat_template_kwargs value the deployment's template cannot use
    "does not appear in the prompt",  # continue_final_message with a template that drops the message
    # Cross-field rules of tool calling no JSON schema states (router/api/openapi_tools.py says them in words)
    "needs a non-empty tools list",  # any tool_choice but none
    "names no function in tools",
    "duplicates the name of an earlier tool",
    "must be a JSON text",
    "differs from another tool's",
    # structured outputs: what the group's grammar compiler refuses, one kind per request
    "does not compile",
    "only one structured output",
    "must be <= max_tokens",  # min_tokens above max_tokens (or the context's room): not in a JSON Schema
)

STATUSES: Counter[tuple[str, int]] = Counter()  # (generation mode, status): reported after the run
REFUSED: Counter[str] = Counter()  # schema-valid bodies refused by the deployment, by reason
STATE: dict[str, dict] = {}


@pytest.fixture(scope="module")
def up(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    with running_up(
        *("--model", str(llama_dir), "--served-model-name", NAME, "--stages", "2", "--replicas", "2"),
        *("--max-model-len", "128", "--num-kv-blocks", "256"),
        log_dir=tmp_path_factory.mktemp("schemathesis"),
    ) as server:
        STATE["pids"] = server.pids()
        yield server


@pytest.fixture(scope="module")
def api(up: UpProcess) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(up.url + "/openapi.json", timeout=10)


def _deployment_refusal(response: schemathesis.Response) -> bool:
    if response.status_code != 400:
        return False
    message = response.json()["error"]["message"]
    reasons = [reason for reason in DEPLOYMENT_LIMITS if reason in message]
    REFUSED.update(reasons[:1])
    return bool(reasons)


def _check(case: schemathesis.Case) -> None:
    positive = case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE
    mode = "positive" if positive else "negative"
    if positive:
        if isinstance(case.body.get("model"), str):
            case.body["model"] = NAME  # the one name this deployment serves (any other is a documented 404)
    response = case.call(timeout=60)
    STATUSES[(mode, response.status_code)] += 1
    if not positive:
        case.validate_response(response, checks=[not_a_server_error])
        return
    case.validate_response(response, checks=POSITIVE_CHECKS)
    assert response.status_code == 200 or _deployment_refusal(response), (
        f"a body valid by /openapi.json was refused: {case.body!r} -> {response.status_code} "
        f"{response.text[:500]}"
    )


# schemathesis' pytest loader (schemathesis.pytest.from_fixture) sets Node._nodeid, which pytest 9 no
# longer has: the operations' strategies run under hypothesis' own @given instead, with the same checks.
def test_schemathesis_no_5xx_and_valid_bodies_served(api: schemathesis.BaseSchema) -> None:
    operations = [api["/v1/completions"]["POST"], api["/v1/chat/completions"]["POST"]]
    cases = st.one_of(*(op.as_strategy(generation_mode=m) for op in operations for m in GenerationMode))

    @seed(SEED)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(cases)
    def one(case: schemathesis.Case) -> None:
        _check(case)

    one()


def test_after_schemathesis_no_exit_no_restart_and_served(up: UpProcess) -> None:
    print("statuses (mode, status): count", dict(sorted(STATUSES.items())))
    print("schema-valid bodies refused by deployment limits:", dict(REFUSED))
    assert sum(STATUSES.values()) > 0, "the schemathesis test did not run first"
    assert STATUSES[("positive", 200)] > 0, STATUSES
    up.assert_unharmed(STATE["pids"], NAME)
