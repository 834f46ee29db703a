"""The router's way goes one direction (issue 30, point 4): parse, validate, plan, pick, stream, format.

tests/router_way_support.py traces one completion through a router on a scripted stage 0 and
measures its back-and-forths (the definition is there and in docs/architecture.md). The goal is at
most 5; today a blocking completion has none and a streamed one (a chat with tools too) only its
per-token loop (format, then stream again for the next token).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from router_way_support import ORDER, STEPS, Way, measure, step_of

ROUTER = Path(__file__).resolve().parents[2] / "services" / "pipeserve" / "router"


@pytest.mark.parametrize(
    ("stream", "tools"),
    [(False, False), (True, False), (True, True)],
    ids=["blocking", "streamed", "chat-tools-streamed"],
)
def test_a_completion_goes_through_the_steps_in_order(llama_dir: Path, stream: bool, tools: bool) -> None:
    """A completion, blocking and streamed; a streamed chat with a tool and the hermes parser."""
    way = measure(stream, chat=tools, model_dir=llama_dir, tools=tools)
    assert len(way.back_and_forths()) <= 5, f"the router's way goes back: {sorted(way.back_and_forths())}"
    assert way.callbacks == set(), f"a later step calls an earlier one: {sorted(way.callbacks)}"
    steps = way.steps()
    assert steps[:6] == list(ORDER), f"the way: {' > '.join(steps)}"
    # what follows is the per-token loop only: stream, format, stream, format, ...
    assert all(s in ("stream", "format") for s in steps[6:]), f"the way: {' > '.join(steps)}"
    assert way.back_and_forths() == ({("format", "stream")} if stream else set())


def test_the_measure_sees_a_way_going_back() -> None:
    way = Way()
    way.on = True
    for module in ("api.protocol", "features.cost", "upstream.serving", "upstream.policy", "api.responses"):
        way._call_from(None, module)
    way._call_from("upstream.generate", "upstream.policy")  # a callback
    assert way.steps() == ["parse", "validate", "stream", "pick", "format", "pick"]
    assert way.back_and_forths() == {("stream", "pick"), ("format", "pick")}
    assert way.callbacks == {("upstream.generate", "upstream.policy")}


def test_every_router_module_has_a_step() -> None:
    modules = [
        ".".join(p.relative_to(ROUTER).with_suffix("").parts)
        for p in ROUTER.rglob("*.py")
        if p.name != "__init__.py"
    ]
    missing = [m for m in modules if step_of(m) is None]
    assert missing == [], f"give these a step in tests/router_way_support.py's STEPS: {missing}"
    assert set(STEPS.values()) <= {*ORDER, "edge"}


def test_no_router_file_over_400_lines_nor_function_over_60() -> None:
    long_files, long_functions = [], []
    for p in ROUTER.rglob("*.py"):
        text = p.read_text()
        if len(text.splitlines()) > 400:
            long_files.append(p.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                if node.end_lineno - node.lineno + 1 > 60:
                    long_functions.append(f"{p.name}:{node.name}")
    assert long_files == [] and long_functions == []
