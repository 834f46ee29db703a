"""Fresh prompts for the side-by-side, the sweep's cells, and the peer's flags per cell.

The prompts are made with the demo model's real tokenizer (and the default model's, where it is on
this machine): no two passes share a prompt, a leading word sequence or — within the reuse distance —
a first token, and text prompts have the token count they were sized to.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pipeserve.bench import cells, peers, prompts
from pipeserve.bench.cells import Cell

KEYS = [f"r{r}/{c.key}" for r in (1, 2, 3) for c in cells.grid("reduced")]


@pytest.fixture(scope="module")
def text_maker(llama_dir) -> prompts.TextPrompts:
    return prompts.hf_text_prompts(str(llama_dir))


def _sets(fresh: prompts.FreshPrompts, n: int = 12, plen: int = 40) -> dict[str, list]:
    return {k: fresh.requests(k, n, plen, 8) for k in KEYS}


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_no_two_passes_share_a_prompt_a_leading_sequence_or_a_near_first_token(kind, text_maker):
    maker = text_maker if kind == "text" else prompts.IdPrompts(2000)
    fresh = prompts.FreshPrompts(maker, seed=11)
    sets = _sets(fresh)
    every = [r for k in KEYS for r in sets[k]]
    sent = [r.text if kind == "text" else tuple(r.prompt) for r in every]
    assert len(set(sent)) == len(sent) == 12 * len(KEYS)
    leads = [maker.leading(r) for r in every]
    assert len(set(leads)) == len(leads) and all(len(x) == prompts.LEAD_WORDS for x in leads)
    # First tokens (under the tokenizer the servers use) never repeat within the reuse distance.
    firsts = [r.prompt[0] for r in every]
    d = fresh.reuse_distance
    assert d > 2 * 64  # longer than the most prompts a server here holds (llama-server's 64 slots)
    assert all(len(set(firsts[i : i + d])) == len(firsts[i : i + d]) for i in range(0, len(firsts), 7))
    # Both servers' passes for one cell and round get the same prompts; a new key, new ones.
    assert fresh.requests(KEYS[0], 12, 40, 8) is sets[KEYS[0]]
    with pytest.raises(ValueError, match="other sizes"):
        fresh.requests(KEYS[0], 5, 40, 8)
    # Another run (another seed) starts elsewhere.
    other = prompts.FreshPrompts(maker, seed=12).requests(KEYS[0], 12, 40, 8)
    assert {maker.leading(r) for r in other}.isdisjoint(leads)


def test_first_tokens_recycle_only_after_the_whole_pool():
    fresh = prompts.FreshPrompts(prompts.IdPrompts(40), seed=0)  # ids 3..39: a pool of 37
    firsts = [r.prompt[0] for r in fresh.requests("a", 37 * 3, 5, 1)]
    assert fresh.reuse_distance == 37
    assert firsts[:37] == firsts[37:74] == firsts[74:] and len(set(firsts[:37])) == 37
    fresh.check_distance(16)
    with pytest.raises(ValueError, match="distinct first tokens"):
        fresh.check_distance(64)


@pytest.mark.parametrize("target", [32, 128, 512, 2048])
def test_text_prompts_have_their_target_token_count(target, text_maker, llama_dir):
    """Counted again by a tokenizer loaded separately (what the server loads), text in, ids out."""
    tok = AutoTokenizer.from_pretrained(llama_dir)
    fresh = prompts.FreshPrompts(text_maker, seed=target)
    for r in fresh.requests("k", 6, target, 4):
        ids = tok(r.text)["input_ids"]
        assert abs(len(ids) - target) <= prompts.tolerance(target)
        assert ids == r.prompt  # the bench's ids are the server's
        assert r.text.isascii() and all(w.isalpha() for w in r.text.split())  # words, no template


def test_text_prompts_on_the_default_model_tokenizer():
    from pipeserve.model.default import default_model

    path = default_model()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the default model is not on this machine")
    maker = prompts.hf_text_prompts(str(path))
    assert len(maker.first_tokens()) >= prompts.MIN_POOL  # corpus words alone lead
    for r in prompts.FreshPrompts(maker, seed=2).requests("k", 4, 512, 4):
        assert abs(len(maker.encode(r.text or "")) - 512) <= prompts.tolerance(512)


def test_sweep_grids_and_cell_filter():
    full, reduced = cells.grid("full"), cells.grid("reduced")
    assert len(full) == 4 * 4 * 2 and len({c.key for c in full}) == 32
    assert [c.key for c in reduced] == ["p128-c1-o64", "p128-c16-o64", "p512-c1-o64", "p512-c16-o64"]
    assert cells.grid("custom", Cell(7, 3, 5)) == [Cell(7, 3, 5)]
    assert [c.key for c in cells.select(full, "p2048-c64-*")] == ["p2048-c64-o64", "p2048-c64-o256"]
    assert len(cells.select(reduced, "*-c1-*, p512-c16-o64")) == 3
    with pytest.raises(ValueError, match="matches none"):
        cells.select(reduced, "p32-*")
    # Requests per pass: two waves of C, at least 8, at most the cap.
    assert [Cell(128, c, 64).num_requests() for c in (1, 4, 16, 64)] == [8, 8, 32, 128]
    assert Cell(128, 64, 64).num_requests(cap=100) == 100 and Cell(1, 1, 1).num_requests(override=3) == 3


def test_llama_server_flags_per_cell():
    """The issue's -np 16 -c 16384 where they fit; more slots for C=64; longer slots for long prompts."""
    assert peers.llama_key(Cell(512, 16, 256)) == "np16-c16384"  # 768 tokens fit a 1024 slot
    assert peers.llama_key(Cell(128, 64, 64)) == "np64-c65536"
    assert peers.llama_key(Cell(2048, 1, 64)) == "np16-c36864"  # 2112 -> slots of 2304
    assert peers.llama_key(Cell(2048, 64, 256)) == "np64-c147456"
    argv = peers.llama_argv("llama-server", "m.gguf", "np64-c65536", 9000)
    t = str(peers.threads())
    assert argv[-8:] == ["-np", "64", "-c", "65536", "-t", t, "-tb", t]
    up = peers.pipeserve_argv("pipeserve", ["--quantization", "gguf"], "s2-l3off", 9001, "/tmp/l")
    assert up == [
        "pipeserve", "up", "--quantization", "gguf", "--port", "9001", "--stages", "2",
        "--hicache-url", "off", "--log-dir", "/tmp/l",
    ]  # fmt: skip
