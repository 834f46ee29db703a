"""A request's failure is the request's, a group's failure is the group's (DESIGN §2.5).

* The sampler cannot produce NaN/inf from any accepted parameter (the request of
  death: temperature 1e-40 killed the last stage in torch.multinomial).
* A request that fails on a stage — stage 0 or the last stage, injected through
  the `fail_token` fault hook, or a sampling row that raises — ends with an error;
  the other requests of the same batch finish HF-exact, every stage holds 0
  blocks afterwards and no process exits.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from conftest import hf_greedy
from pipeserve import LLM, SamplingParams
from pipeserve.engine.plan import SamplingSpec
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.worker.sampler import Sampler, _filter
from serving_support import generate, greedy_request, live_group, metric, stub, wait_until

DEATH_TEMPERATURES = [1e-40, 1e-38, 1e-300, 5e-324, 1e-6, 3.4e38, 1e300, 1.7976931348623157e308]
POISON = 777  # a token id inside the demo vocabulary that the fault hook fails or crashes on


def spec(temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0, seed=None):
    return SamplingSpec(float(temperature), top_k, float(top_p), float(min_p), seed, None)


@pytest.mark.parametrize("temperature", DEATH_TEMPERATURES)
def test_no_accepted_temperature_makes_nan(temperature: float) -> None:
    SamplingParams(temperature=temperature)  # accepted by the schema
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 30
    sampler = Sampler(torch.device("cpu"), seed=1)
    specs = [spec(temperature), spec(temperature, top_p=1e-9), spec(temperature, min_p=1.0, seed=7)]
    tokens, failures = sampler(logits, ["a", "b", "c"], specs, [0, 0, 0])
    assert failures == [] and len(tokens) == 3
    assert all(0 <= t.token_id < 500 for t in tokens)
    if temperature < 1e-5:  # greedy below the epsilon, like vLLM
        assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    probs = _filter(logits, specs)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))


def test_filter_edges_keep_the_top_token() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    one_hot = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert torch.equal(_filter(logits, [spec(top_p=1e-12)]), one_hot)
    assert torch.equal(_filter(logits, [spec(min_p=1.0)]), one_hot)
    wide = _filter(logits, [spec(top_k=10**9)])
    assert torch.allclose(wide, logits.softmax(-1))
    flat = _filter(logits, [spec(temperature=1e300)])
    assert torch.allclose(flat, torch.full((1, 4), 0.25), atol=1e-3)


def test_a_failing_row_fails_alone() -> None:
    """A row whose logits are all NaN cannot be sampled; the other rows are sampled as if alone."""
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    bad = logits.clone()
    bad[1] = float("nan")
    sampler = Sampler(torch.device("cpu"))
    specs = [spec(seed=3), spec(seed=4), spec(0.0)]
    tokens, failures = sampler(bad, ["a", "b", "c"], specs, [5, 5, 5])
    assert [f.req_id for f in failures] == ["b"] and "sampling failed" in failures[0].reason
    alone, _ = Sampler(torch.device("cpu"))(logits[[0, 2]], ["a", "c"], [specs[0], specs[2]], [5, 5])
    assert [(t.req_id, t.token_id) for t in tokens] == [(t.req_id, t.token_id) for t in alone]


def test_logprobs_beyond_a_small_vocabulary() -> None:
    logits = torch.randn(1, 8)
    s = SamplingSpec(0.0, -1, 1.0, 0.0, None, 20)
    tokens, failures = Sampler(torch.device("cpu"))(logits, ["a"], [s], [0])
    assert not failures and len(tokens[0].top_logprobs) == 8


@pytest.mark.parametrize("rank", [0, 1])
def test_request_failure_on_a_stage_fails_only_that_request(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """Injected on stage 0 (first) or stage 1 (last, samples): the poison request gets INTERNAL,
    the requests in the same batches finish HF-exact, both stages end holding 0 blocks, nobody exits."""
    monkeypatch.setenv("PIPESERVE_FAULTS", json.dumps({"fail_token": POISON, "fail_rank": rank}))
    prompts = [[5, 17, 99, 3, 250, 41, 7 + i] for i in range(4)]
    poison = [11, 12, POISON, 13, 14]
    with live_group(llama_dir, 2, tmp_path) as slot:
        s = stub(slot.grpc_target)
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            results[i] = generate(s, greedy_request(f"ok-{i}", prompts[i], 24, ignore_eos=True))[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        with pytest.raises(grpc.RpcError) as err:
            generate(s, greedy_request("poison", poison, 24, ignore_eos=True))
        for t in threads:
            t.join(60)
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
        assert "request failed" in err.value.details() and f"stage {rank}" in err.value.details()
        for i, p in enumerate(prompts):
            assert results[i] == hf_greedy(llama_dir, p, 24, ignore_eos=True), i

        def drained() -> bool:
            text = httpx.get(slot.health_url(0) + "/metrics").text
            held = [metric(text, "pipeserve:group_stage_blocks_held", stage=str(r)) for r in (0, 1)]
            return metric(text, "pipeserve:kv_blocks_used") == 0 and held == [0, 0]

        wait_until(drained, 10, "every stage holding 0 blocks")
        text = httpx.get(slot.health_url(0) + "/metrics").text
        assert metric(text, "pipeserve:request_errors_total") == 1
        assert not slot.group_exited()
        assert s.Health(pb.HealthRequest(), timeout=5).ready
        # The group keeps serving: the same poison again, then a normal request.
        with pytest.raises(grpc.RpcError):
            generate(s, greedy_request("poison-2", poison, 4))
        assert generate(s, greedy_request("after", prompts[0], 5, ignore_eos=True))[1] == "length"


def test_duplicate_request_id_is_already_exists(llama_dir: Path, tmp_path: Path) -> None:
    """A client error is never UNAVAILABLE (which would take a healthy group out of routing)."""
    with live_group(llama_dir, 1, tmp_path) as slot:
        s = stub(slot.grpc_target)
        # Long enough to outlive the duplicate's round trip on a loaded machine: the demo model
        # decodes a token in ~1.5 ms on the native step, so 400 tokens could end first.
        call = s.Generate(greedy_request("dup", [5, 6, 7], 2000, ignore_eos=True), timeout=60)
        next(call)
        with pytest.raises(grpc.RpcError) as err:
            generate(s, greedy_request("dup", [5, 6, 7], 4))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        call.cancel()

        def freed() -> bool:  # the id is free once its request is neither running nor waiting
            load = s.Load(pb.LoadRequest(), timeout=5)
            return load.running == 0 and load.waiting == 0

        wait_until(freed, 10, "the first call aborted")
        assert generate(s, greedy_request("dup", [5, 6, 7], 3, ignore_eos=True))[1] == "length"


def test_offline_llm_reports_a_failed_request(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPESERVE_FAULTS", json.dumps({"fail_token": POISON, "fail_rank": 0}))
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)
    good = [5, 17, 99, 3]
    outs = llm.generate([good, [1, POISON, 2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == hf_greedy(llama_dir, good, 8, ignore_eos=True)
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    assert math.isfinite(llm.engine.executor.meter.busy_s)


def test_readyz_and_health_agree_the_moment_the_group_stops(llama_dir: Path, tmp_path: Path) -> None:
    """Once a call has ended UNAVAILABLE because the group stopped, no /readyz probe started after
    that says ready (probed back to back from another thread), and neither does Health."""
    with live_group(llama_dir, 2, tmp_path) as slot:
        s = stub(slot.grpc_target)
        probes: list[tuple[float, int]] = []  # (start time, status; 0 when the stage no longer answers)
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=2) as c:
                while not stop.is_set():
                    t = time.monotonic()
                    try:
                        probes.append((t, c.get(slot.health_url(0) + "/readyz").status_code))
                    except httpx.TransportError:
                        probes.append((t, 0))

        call = s.Generate(greedy_request("long", [5, 6, 7], 2000, ignore_eos=True), timeout=60)
        next(call)
        prober = threading.Thread(target=probe)
        prober.start()
        try:
            os.kill(slot.group.procs[1].pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            seen_at = time.monotonic()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            try:
                assert not s.Health(pb.HealthRequest(), timeout=2).ready
            except grpc.RpcError as e:  # the server may already be closing: that is not "ready" either
                assert e.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.5)
        finally:
            stop.set()
            prober.join(10)
        after = [code for t, code in probes if t > seen_at]
        assert after and 200 not in after, after
