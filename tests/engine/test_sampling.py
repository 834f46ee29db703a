"""Sampling: seeded reproducibility independent of batch mix, filters, logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import hf_logits, random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.engine.plan import SamplingSpec
from pipeserve.worker.sampler import CANDIDATES, Sampler, _distributions, _filter


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), max_model_len=256, num_kv_blocks=128)


def _gen(llm: LLM, prompts: list[list[int]], **kw) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, **kw))
    return [o.outputs[0].token_ids for o in outs]


def test_same_seed_same_tokens_across_batch_mixes(llm: LLM) -> None:
    prompts = random_prompts(4, 5, 40, 1024, seed=20)
    alone = _gen(llm, prompts[:1], temperature=1.0, seed=123)[0]
    crowd = random_prompts(6, 5, 60, 1024, seed=21)
    mixed = llm.generate(
        prompts[:1] + crowd,
        [SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=123)]
        + [SamplingParams(max_tokens=24, temperature=0.7) for _ in crowd],
    )
    assert mixed[0].outputs[0].token_ids == alone
    assert _gen(llm, prompts[:1], temperature=1.0, seed=123)[0] == alone


def test_different_seeds_differ(llm: LLM) -> None:
    prompt = random_prompts(1, 10, 10, 1024, seed=22)
    runs = {tuple(_gen(llm, prompt, temperature=1.5, seed=s)[0]) for s in range(4)}
    assert len(runs) == 4


def test_seeded_sampling_survives_preemption(llama_dir: Path, llm: LLM) -> None:
    prompts = random_prompts(8, 40, 70, 1024, seed=23)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=i) for i in range(8)]
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=20, enable_prefix_caching=False)
    squeezed = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert squeezed == roomy


def test_top_k_one_is_greedy(llm: LLM) -> None:
    prompts = random_prompts(3, 5, 30, 1024, seed=24)
    assert _gen(llm, prompts, temperature=1.0, top_k=1, seed=5) == _gen(llm, prompts, temperature=0)


def test_filters_restrict_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    specs = [
        SamplingSpec(1.0, 5, 1.0, 0.0, None, None),
        SamplingSpec(1.0, -1, 0.5, 0.0, None, None),
        SamplingSpec(1.0, -1, 1.0, 0.2, None, None),
        SamplingSpec(0.5, -1, 1.0, 0.0, None, None),
    ]
    probs = _filter(logits, specs)
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    assert (probs[0] > 0).sum() == 5 and set(probs[0].nonzero().flatten().tolist()) == set(
        logits[0].topk(5).indices.tolist()
    )
    p1 = logits[1].softmax(-1)
    kept = probs[1] > 0
    assert p1[kept].sum() >= 0.5 and p1[kept].sum() - p1[kept].min() < 0.5  # smallest set reaching 0.5
    p2 = logits[2].softmax(-1)
    assert torch.equal(probs[2] > 0, p2 >= 0.2 * p2.max())
    assert torch.allclose(probs[3], (logits[3] / 0.5).softmax(-1))


def test_candidate_distributions_equal_the_full_sort() -> None:
    """`_distributions` samples a row from its CANDIDATES most probable tokens only when the
    filters provably keep nothing past them: each row's distribution equals `_filter`'s (same
    support, same probabilities), peaked rows take the candidates, flat ones the full sort."""
    torch.manual_seed(1)
    vocab = 4 * CANDIDATES
    peaked, flat = torch.randn(6, vocab) * 8, torch.randn(6, vocab) * 0.1
    specs = [
        SamplingSpec(1.0, 5, 1.0, 0.0, None, None),  # top-k within the candidates
        SamplingSpec(0.7, -1, 0.9, 0.0, None, None),  # top-p
        SamplingSpec(1.0, -1, 1.0, 0.1, None, None),  # min-p
        SamplingSpec(1.3, CANDIDATES + 7, 0.95, 0.0, None, None),  # top-k past the candidates
        SamplingSpec(0.8, -1, 1.0, 0.0, None, None),  # no filter: softmax(logits / T)
        SamplingSpec(1.0, 40, 0.5, 0.05, None, None),  # all three
    ]
    logits = torch.cat([peaked, flat])
    dists = _distributions(logits, specs + specs)
    want = _filter(logits, specs + specs)
    took = []
    for row, ((probs, ids), ref) in enumerate(zip(dists, want, strict=True)):
        full = probs if ids is None else torch.zeros(vocab).scatter(0, ids, probs)
        assert torch.equal(full > 0, ref > 0), f"row {row}: another support"
        assert torch.allclose(full, ref, atol=1e-6, rtol=1e-5), f"row {row}"
        took.append(ids is not None)
    peaked_took, flat_took = [True, True, True, False, False, True], [True, False, False, False, False, True]
    assert took == [*peaked_took, *flat_took], took


def test_sampler_draws_from_distribution() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 1e-9]]))
    spec = SamplingSpec(1.0, -1, 1.0, 0.0, None, None)
    counts = torch.zeros(4)
    for _ in range(2000):
        counts[sampler(logits, ["r"], [spec], [0])[0][0].token_id] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq[:3], torch.tensor([0.7, 0.2, 0.1]), atol=0.04)
    assert counts[3] == 0


def test_logprobs_match_hf(llama_dir: Path, llm: LLM) -> None:
    prompt = random_prompts(1, 30, 30, 1024, seed=25)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    ref = hf_logits(llama_dir, prompt).log_softmax(-1)
    lp, top = out.logprobs[0]
    assert out.token_ids[0] == int(ref.argmax())
    assert lp == pytest.approx(float(ref.max()), abs=1e-4)
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()
    assert [v for _, v in top] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-4)
