"""The router's way: each router module's step, and a tracer that measures a request's way (issue 30).

A completion goes through the router in one direction: parse -> validate -> plan the fan-out ->
pick a group -> stream -> format. `STEPS` gives each router module its step, declared once here
(docs/architecture.md, "The router's way", shows the same table); "edge" is the HTTP conductor
(http/handlers.py, which drives one completion) and what every step may use: the HTTP edge, errors,
metrics, traces, the OpenAPI document, discovery.

The measure (`Way`, driven by `sys.settrace` on the router's thread):

* the way = the steps entered by calls, in order, repeats merged. A call counts where it starts a
  frame (a coroutine resumed by the event loop, a return to a caller: neither is a call) and its
  callee is a step module; calls into edge modules are transparent, and returns to the conductor
  are not back-and-forths (it is where the way is driven from);
* a back-and-forth = the way entering a step earlier than one already reached (the pair: the step
  module left, the module entered), each distinct pair once, so a per-token loop (stream <->
  format, one chunk per token) counts once; plus
* a callback = a call, anywhere in the trace, from a module of a later step into a module of an
  earlier one (the pair: caller module, callee module; the caller is the nearest frame up the stack
  in a step module, so a call through an edge module or a library keeps its step caller).

`Way.back_and_forths()` is the union of both kinds of pairs. The strict figure (`strict_returns`)
counts every return to any router module already left, helpers included, as the first walk did.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

ROUTER = "pipeserve.router."
ORDER = ("parse", "validate", "plan", "pick", "stream", "format")

# Longest prefix wins: "features.tool_parsers" covers its modules.
STEPS: dict[str, str] = {
    # edge: the conductor and what every step may use
    "http": "edge",  # app, edge, http_guard, handlers (the conductor), standalone, multi
    "errors": "edge",
    "upstream.metrics": "edge",
    "upstream.trace": "edge",
    "upstream.replicas": "edge",  # the groups' state: health polls, limits, channels, in-flight counts
    "upstream.groups": "edge",  # one group's state, and which are routable
    "upstream.discovery": "edge",  # the set of groups, followed off the way (discovery, discovery_k8s)
    "upstream.models_file": "edge",
    "api.openapi": "edge",  # the OpenAPI document (openapi, openapi_chat, ...): read at start-up
    # the way
    "api.protocol": "parse",  # protocol, protocol_fields
    "api.chat_args": "parse",
    "features.structured": "parse",  # the structured-output fields of the body
    "features.tools": "parse",  # tools, tool_choice and the messages' tool fields; the parser named
    "features.tool_output": "format",  # the tool calls in the response
    "features.cost": "validate",
    "upstream.fanout": "plan",
    "upstream.policy": "pick",
    "upstream.upstream": "pick",  # a group for each call, the retry rule
    "upstream.generate": "stream",
    "upstream.serving": "stream",
    "api.results": "stream",  # what a stream collects per choice; a fan-out folded back
    "http.sse_events": "stream",
    "api.responses": "format",
    "api.chat_output": "format",
    "features.echo": "format",
    "features.reasoning": "format",
    "features.tool_parsers": "format",
}


def step_of(module: str) -> str | None:
    """`module` relative to pipeserve.router ("api.protocol"); None where no entry covers it."""
    best = None
    for prefix in STEPS:
        if (module == prefix or module.startswith(prefix)) and (best is None or len(prefix) > len(best)):
            best = prefix
    return STEPS[best] if best is not None else None


def rank(module: str) -> int | None:
    step = step_of(module)
    return ORDER.index(step) if step in ORDER else None


def merged(steps: list[str]) -> list[str]:
    return [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]


def strict_returns(modules: list[str]) -> int:
    """Entries into a module already left (repeats merged first): every return counts."""
    m = merged(modules)
    return sum(1 for i, s in enumerate(m) if s in m[:i])


def _router_module(frame: FrameType | None) -> str | None:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name[len(ROUTER) :] if name.startswith(ROUTER) else None


class Way:
    """The trace of one request, from the conductor's first call (`start`, in module `start_module`)
    until `done` is set: the strict module walk, the way and the callbacks."""

    GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR

    def __init__(self, start: str = "completions", start_module: str = "http.handlers") -> None:
        self.start, self.start_module = start, start_module
        self.on = False
        self.done = False
        self.modules: list[str] = []  # strict: every router module run, returns included
        self.way: list[str] = []  # step modules entered by calls, repeats merged
        self.back: set[tuple[str, str]] = set()  # (step module left, earlier step's module entered)
        self.back_steps: set[tuple[str, str]] = set()  # (latest step reached, earlier step entered)
        self.callbacks: set[tuple[str, str]] = set()  # (later step's caller, earlier step's callee)
        self._reached = -1
        self.entries = 0  # every entry of the way into an earlier step, repeats of a loop included
        self._started: dict[int, FrameType] = {}  # generator-like frames already entered (kept alive)

    def _note(self, module: str | None) -> None:
        if self.on and not self.done and module and (not self.modules or self.modules[-1] != module):
            self.modules.append(module)

    def _fresh(self, frame: FrameType) -> bool:
        if not frame.f_code.co_flags & self.GENERATOR_FLAGS:
            return True
        if id(frame) in self._started:
            return False
        self._started[id(frame)] = frame
        return True

    def _call(self, frame: FrameType, module: str) -> None:
        caller, cr, up = None, None, frame.f_back
        while up is not None and cr is None:  # the nearest caller of a step: edge frames are transparent
            caller = _router_module(up)
            cr, up = (rank(caller) if caller is not None else None), up.f_back
        self._call_from(caller if cr is not None else None, module)

    def _call_from(self, caller: str | None, module: str) -> None:
        """A call into `module` from `caller` (a step module, or None: the conductor, the edge)."""
        r = rank(module)
        if r is None:
            return  # an edge module: transparent
        cr = rank(caller) if caller is not None else None
        if cr is not None and cr > r and caller is not None:
            self.callbacks.add((caller, module))
        if self.way and self.way[-1] == module:
            return
        if r < self._reached:
            self.back.add((self.way[-1], module))
            self.back_steps.add((ORDER[self._reached], ORDER[r]))
            self.entries += 1
        self._reached = max(self._reached, r)
        self.way.append(module)

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        module = _router_module(frame)
        if module is None:
            return None if event == "call" else self.trace
        if event == "call":
            if frame.f_code.co_name == self.start and module == self.start_module:
                self.on = True
            self._note(module)
            if self.on and not self.done and self._fresh(frame):
                self._call(frame, module)
            return self.trace
        if event == "return":
            self._note(_router_module(frame.f_back))
        return self.trace

    def back_and_forths(self) -> set[tuple[str, str]]:
        """The measure: distinct (later step, earlier step) pairs, of the way going back and of callbacks."""
        return self.back_steps | {(step_of(a) or "?", step_of(b) or "?") for a, b in self.callbacks}

    def steps(self) -> list[str]:
        return merged([step_of(m) or "?" for m in self.way])


def measure(
    stream: bool = False, chat: bool = False, model_dir: Path | None = None, tools: bool = False
) -> Way:
    """The way of one request (max_tokens 4) through a router on a scripted stage 0 (real gRPC,
    real uvicorn, the demo model's tokenizer); `model_dir`: an existing demo model (else a new one);
    `tools`: a chat with a tool and the hermes tool-call parser (its output parsed as tokens come)."""
    from pipeserve.model.demo import write_demo_model
    from pipeserve.model.demo_spec import DemoSpec
    from pipeserve.tokenizer import TokenizerAssets
    from router_support import RouterHarness, ScriptedStage

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir or write_demo_model(Path(tmp) / "llama", DemoSpec(arch="llama"))
        tok = TokenizerAssets.load(model)
        stage = ScriptedStage(tok.encode(" the quick brown fox"), vocab_size=tok.tokenizer.get_vocab_size())
        way = Way("chat" if chat else "completions")
        threading.settrace(way.trace)  # the harness's thread starts after this
        try:
            # health polls every 60 s: none run during the request, only its own way is traced
            parser = {"tool_call_parser": "hermes"} if tools else {}
            with RouterHarness(model, {"g0": stage}, health_interval_s=60.0, **parser) as h:
                body: dict[str, Any] = {"max_tokens": 4, "stream": stream}
                if chat:
                    body["messages"] = [{"role": "user", "content": "hello there"}]
                    if tools:
                        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
                else:
                    body["prompt"] = "hello there"
                path = "/v1/chat/completions" if chat else "/v1/completions"
                r = httpx.post(h.url + path, json=body, timeout=30)
                assert r.status_code == 200, r.text
                way.done = True
        finally:
            threading.settrace(None)  # type: ignore[arg-type]
    return way
