"""How often a completion's way through the router returns to a module it already left (issue 30).

    .venv/bin/python benchmarks/router_walk.py [--stream]

One /v1/completions request is sent to a router on a scripted stage 0 (tests/router_support.py: real
gRPC, real uvicorn, the demo model's tokenizer). `threading.settrace` follows the router's thread
from the first call into `Router.completions` until the response has been sent. The walk is the
sequence of router modules whose code runs (a `call` event enters a frame's module; a `return`
goes back to the caller's module; frames outside pipeserve.router are transparent), with repeats
merged: A B A C A is 5 steps and 2 returns (to A twice). Printed: the returns counted by module and
by layer (errors, features, api, upstream, http; tests/test_import_graph.py's ROUTER_LAYERS), and
the distinct return edges (a per-token loop counts once) and the walk itself.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from pipeserve.model.demo import write_demo_model
from pipeserve.model.demo_spec import DemoSpec
from pipeserve.tokenizer import TokenizerAssets
from router_support import RouterHarness, ScriptedStage

ROUTER = "pipeserve.router."


class Walk:
    """The router modules a traced thread runs, in order, from Router.completions on."""

    def __init__(self) -> None:
        self.on = False
        self.done = False
        self.steps: list[str] = []

    def _note(self, module: str | None) -> None:
        if self.on and not self.done and module and (not self.steps or self.steps[-1] != module):
            self.steps.append(module)

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(ROUTER):
            return None if event == "call" else self.trace
        if event == "call":
            if frame.f_code.co_name == "completions" and name.endswith("http.handlers"):
                self.on = True
            self._note(name[len(ROUTER) :])
            return self.trace
        if event == "return":
            back = frame.f_back
            back_name = back.f_globals.get("__name__", "") if back is not None else ""
            if back_name.startswith(ROUTER):
                self._note(back_name[len(ROUTER) :])
        return self.trace


def returns(steps: list[str]) -> int:
    """Steps that enter a module already left (repeats merged first)."""
    merged = [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]
    return sum(1 for i, s in enumerate(merged) if s in merged[:i])


def return_edges(steps: list[str]) -> set[tuple[str, str]]:
    """Distinct (left, entered) pairs of those returns: a loop's repeats (one per token) count once."""
    merged = [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]
    return {(merged[i - 1], s) for i, s in enumerate(merged) if s in merged[:i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stream", action="store_true", help="a streamed completion instead")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / "llama", DemoSpec(arch="llama"))
        tok = TokenizerAssets.load(model)
        stage = ScriptedStage(tok.encode(" the quick brown fox"), vocab_size=tok.tokenizer.get_vocab_size())
        walk = Walk()
        threading.settrace(walk.trace)  # the harness's thread starts after this
        try:
            # health polls every 60 s: none run during the request, only its own way is traced
            with RouterHarness(model, {"g0": stage}, health_interval_s=60.0) as h:
                body = {"prompt": "hello there", "max_tokens": 4, "stream": args.stream}
                r = httpx.post(h.url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
                walk.done = True
        finally:
            threading.settrace(None)  # type: ignore[arg-type]
    layers = [s.split(".")[0] for s in walk.steps]
    print(f"completion (stream={args.stream}): {len(walk.steps)} module steps")
    print(f"returns to a module already left: {returns(walk.steps)}")
    print(f"returns to a layer already left:  {returns(layers)}")
    edges, layer_edges = return_edges(walk.steps), return_edges(layers)
    print(f"distinct return edges, module / layer: {len(edges)} / {len(layer_edges)}")
    print("layer return edges:", sorted(layer_edges))
    print("module return edges:", sorted(edges))
    print("walk:", " > ".join(walk.steps))


if __name__ == "__main__":
    main()
