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


def test_the_loop_steps_on_the_thread_that_built_the_engine(llama_dir) -> None:
    thread = engine_thread()
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=256, max_num_seqs=2)

    def build():
        return build_engine(config), threading.get_ident()

    engine, builder = thread.submit(build).result(timeout=120)
    assert builder != threading.get_ident()
    stepped_on: set[int] = set()
    step = engine.step

    def recorded_step():  # the real step, with the calling thread noted
        stepped_on.add(threading.get_ident())
        return step()

    engine.step = recorded_step  # type: ignore[method-assign]
    loop = EngineLoop(engine, max_waiting=4, thread=thread)
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
    assert stepped_on == {builder}
