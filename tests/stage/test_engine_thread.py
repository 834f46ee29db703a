"""Stage 0 runs its engine loop on the thread that built the engine.

torch's OpenMP pools belong to the calling thread; decode steps run from another thread than the
one that loaded and packed the weights measured ~25 % slower (benchmarks/RESULTS.md), so
serve_leader builds the engine on `engine_thread()` and EngineLoop runs there. This drives a real
engine on the demo model: the thread of every engine step is recorded and must be the builder's.
"""

from __future__ import annotations

import queue
import threading

from pipeserve.config import EngineConfig
from pipeserve.sampling_params import SamplingParams
from pipeserve.stage.assemble import build_engine
from pipeserve.stage.engine_loop import Delta, EngineLoop, engine_thread


class QueueSink:
    def __init__(self) -> None:
        self.deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()

    def push(self, delta: Delta) -> None:
        self.deltas.put(delta)


def run_one(llama_dir, on_step) -> int:
    """Serve one 4-token greedy request on a real EngineLoop; `on_step(loop)` runs before each step.
    Returns the id of the thread that built the engine."""
    thread = engine_thread()
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=256, max_num_seqs=2)

    def build():
        return build_engine(config), threading.get_ident()

    engine, builder = thread.submit(build).result(timeout=120)
    loop = EngineLoop(engine, max_waiting=4, thread=thread)
    step = engine.step

    def recorded_step():  # the real step, after the test's look at the loop
        on_step(loop)
        return step()

    engine.step = recorded_step  # type: ignore[method-assign]
    sink = QueueSink()
    try:
        loop.start()
        loop.submit("r1", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), sink)
        tokens = []
        while True:
            delta = sink.deltas.get(timeout=60)
            tokens += delta.token_ids
            if delta.final:
                break
        assert delta.error is None and len(tokens) == 4
    finally:
        loop.end("test over")
        assert loop.join(10)
        engine.shutdown()
        thread.shutdown(wait=True)
    return builder


def test_the_loop_steps_on_the_thread_that_built_the_engine(llama_dir) -> None:
    stepped_on: set[int] = set()
    builder = run_one(llama_dir, lambda loop: stepped_on.add(threading.get_ident()))
    assert builder != threading.get_ident()
    assert stepped_on == {builder}


def test_the_gauges_count_a_request_before_its_first_plan(llama_dir) -> None:
    """A submitted request is in the gauges before any plan runs: a client that saw its first token,
    cancelled it and then polled Load until running and waiting were 0 could otherwise read the
    previous step's view and reuse the id while it was still live (seen under make test-stress)."""
    seen: list[tuple[int, int]] = []
    run_one(llama_dir, lambda loop: seen.append((loop.stats.running, loop.stats.waiting)))
    assert seen and sum(seen[0]) == 1, seen  # the first plan's request: waiting (or running) already
