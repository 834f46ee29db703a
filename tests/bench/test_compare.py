"""`pipeserve bench --compare`: a sweep against two servers, fresh prompts per pass, ratios from the runs.

The stand-in servers are slot_server.py's (llama-server's slot prompt cache and its way of reporting
reuse, with known sleeps); the slow test runs two real `pipeserve up` on the demo model (the second
standing in for the peer, e.g. llama.cpp's llama-server, which tests do not build). The RSS sampler
is checked on a real process tree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

import pytest
from slot_server import slot_app
from test_bench import Served, bench_cli

from pipeserve.bench import sweep_report
from pipeserve.bench.host import ForeignCpu, RssSampler, tree_pids, tree_rss
from serving_support import UpProcess

pytestmark = pytest.mark.timeout(180)

CELLS = "p128-c1-o64,p128-c16-o64"


def _argv(url: str, peer: str, tokenizer, out, *extra: str) -> list[str]:
    argv = ["bench", "--url", url, "--compare", peer, "--sweep", "reduced", "--cells", CELLS]
    argv += ["--cell-requests", "4", "--warmup", "1", "--tokenizer", str(tokenizer), "--json", str(out)]
    return [*argv, *extra]


def _check_arithmetic(doc: dict) -> None:
    """Every figure is the median of that side's passes; every ratio self's median over the peer's."""
    agg = doc["aggregate"]["cells"]
    for cell in doc["cells"]:
        for fig, *_ in sweep_report.FIGURES:
            medians = {}
            for side in ("self", "peer"):
                vals = [p["figures"][fig] for p in doc["passes"] if p["side"] == side and p["cell"] == cell]
                vals = [v for v in vals if v is not None]
                medians[side] = statistics.median(vals) if vals else None
                got = agg[cell][fig][side]
                assert (got and got["median"]) == pytest.approx(medians[side]), (cell, fig, side)
            if medians["self"] is not None and medians["peer"]:
                assert agg[cell][fig]["ratio"] == pytest.approx(medians["self"] / medians["peer"])


def test_compare_sweep_on_stand_ins(llama_dir, tmp_path, capsys):
    """Self answers 10x slower to the first token: the TTFT ratio misses (bold); the rounds alternate;
    every server sees every prompt once, the two servers the same prompts; the figures are medians."""
    slow, s_state = slot_app(ttft=0.20, itl=0.002)
    fast, p_state = slot_app(ttft=0.02, itl=0.002)
    out, md, png = tmp_path / "c.json", tmp_path / "R.md", tmp_path / "r.png"
    with Served(slow) as a, Served(fast) as b:
        extra = ("--compare-rounds", "3", "--results-md", str(md), "--plot", str(png))
        assert bench_cli(_argv(a.url, b.url, llama_dir, out, *extra)) == 0
    doc = json.loads(out.read_text())
    order = [(p["round"], p["side"], p["cell"]) for p in doc["passes"]]
    cells = CELLS.split(",")
    assert order == [(r, s, c) for r in (1, 2, 3) for s in ("self", "peer") for c in cells]
    # 3 rounds x 2 cells x (1 warmup + 4 timed); no prompt twice, none reused, both sides alike.
    for state in (s_state, p_state):
        assert len(state["prompts"]) == 3 * 2 * 5 == len(set(state["prompts"]))
        assert max(state["cache_n"]) == 0
    assert Counter(s_state["prompts"]) == Counter(p_state["prompts"])
    assert all(p["cache"]["hit_tokens"] == 0 and p["cache"]["reporting"] == 5 for p in doc["passes"])
    # Text prompts of 128 tokens under the model's tokenizer; the stand-in counts words (fewer).
    assert all(isinstance(x, str) and 30 < len(x.split()) < 128 for x in s_state["prompts"])
    _check_arithmetic(doc)
    ttft = doc["aggregate"]["cells"]["p128-c1-o64"]["ttft_p50_ms"]
    assert ttft["ratio"] > 1.5 and ttft["miss"]  # only the direction: a loaded machine adds to both
    text = capsys.readouterr().out
    assert f"**{ttft['ratio']:.2f}×**" in text and f"**{ttft['ratio']:.2f}×**" in md.read_text()
    assert "--compare" in md.read_text() and "![ratios](r.png)" in md.read_text() and png.is_file()
    assert doc["failed_requests"] == 0 and doc["aggregate"]["servers"]["ready_s"]["ratio"] is None


def test_compare_fails_on_cache_hits_and_on_failed_requests(llama_dir, tmp_path, capsys):
    """The same prompts twice (a fixed --prompt-seed, servers kept up): the second run hits the slot
    caches and fails, saying so; a peer that fails requests fails the run too."""
    app, state = slot_app(slots=64)
    out = tmp_path / "c.json"
    one = ("--compare-rounds", "1", "--cells", "p128-c1-o64")
    with Served(app) as a, Served(slot_app()[0]) as b:
        assert bench_cli(_argv(a.url, b.url, llama_dir, out, *one, "--prompt-seed", "5")) == 0
        assert bench_cli(_argv(a.url, b.url, llama_dir, out, *one, "--prompt-seed", "5")) == 1
    assert "CACHE HITS" in capsys.readouterr().err and max(state["cache_n"]) > 0
    assert len(json.loads(out.read_text())["passes"]) == 0  # the first pass of the run failed
    failing, _ = slot_app(fail_every=3)
    with Served(slot_app()[0]) as a, Served(failing) as b:
        assert bench_cli(_argv(a.url, b.url, llama_dir, out, *one)) == 1
    doc = json.loads(out.read_text())
    assert doc["failed_requests"] > 0 and "FAILED" in capsys.readouterr().out


def test_compare_rejects_other_modes_and_bad_arguments():
    with pytest.raises(ValueError, match="--router-overhead"):
        bench_cli(["bench", "--compare", "http://h:1", "--router-overhead", "--grpc", "h:2"])
    with pytest.raises(ValueError, match="--tokenizer"):
        bench_cli(["bench", "--compare", "http://h:1"])
    with pytest.raises(ValueError, match="no such process"):
        bench_cli(["bench", "--compare", "http://h:1", "--prompt-kind", "ids", "--peer-pid", "999999999"])
    with pytest.raises(ValueError, match="--compare-rounds"):
        bench_cli(["bench", "--compare", "http://h:1", "--prompt-kind", "ids", "--compare-rounds", "0"])
    with pytest.raises(ValueError, match="matches none"):
        bench_cli(["bench", "--compare", "http://h:1", "--prompt-kind", "ids", "--cells", "p3-*"])


def test_rss_sampler_sums_the_tree_while_it_runs():
    """A parent with two children holding ~64 MB each: the sampled peak counts all three at once; a
    window opened after they exit sees only the parent."""
    child = "import time; b = b'x' * (64 << 20); time.sleep(1.5)"  # written bytes: resident
    spawn = f"subprocess.Popen([sys.executable, '-c', {child!r}])"
    script = f"import subprocess, sys, time; ps = [{spawn} for _ in 'ab']; [p.wait() for p in ps]"
    script += "; time.sleep(30)"
    root = subprocess.Popen([sys.executable, "-c", script])
    try:
        with RssSampler(root.pid, interval_s=0.05) as sampler:
            deadline = time.monotonic() + 20
            while len(tree_pids(root.pid)) < 3:
                assert time.monotonic() < deadline, "children did not start"
                time.sleep(0.05)
            while len(tree_pids(root.pid)) > 1:  # the children allocate, hold, exit
                assert time.monotonic() < deadline, "children did not exit"
                time.sleep(0.05)
            sampler.mark()
            time.sleep(0.2)
            after = sampler.read_window()
        assert sampler.peak >= 2 * (64 << 20) + tree_rss(root.pid) * 0.9
        assert after == pytest.approx(tree_rss(root.pid), rel=0.2) and after < 64 << 20
    finally:
        root.kill()
        root.wait(timeout=10)
    assert tree_pids(root.pid) == []


def test_foreign_cpu_counts_what_runs_outside_the_tree():
    """One process spinning for a second, watched at once as the server tree and as a stranger: the
    stranger's view counts its time as foreign, the tree's does not — by about one CPU's share."""
    loop = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    spin = subprocess.Popen([sys.executable, "-c", loop])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        as_tree, as_stranger = ForeignCpu(spin.pid), ForeignCpu(idle.pid)
        time.sleep(1.0)
        inside, outside = as_tree.share(), as_stranger.share()
    finally:
        spin.kill(), idle.kill()
        spin.wait(timeout=10), idle.wait(timeout=10)
    assert inside is not None and outside is not None
    assert 0.15 < outside - inside <= 1.05 / (os.cpu_count() or 1)  # the spinner: at most one CPU
    assert ForeignCpu(None).share() is None  # a server known by URL only


@pytest.mark.slow
def test_compare_two_live_pipeserve_servers(llama_dir, tmp_path, capsys):
    """Two real `pipeserve up` (S=1) on fresh text prompts: no prefix-cache hit by their own counters,
    the same prompt tokens on both, the RSS sampled over each whole tree, ratios from the runs."""
    args = ("--model", str(llama_dir), "--stages", "1", "--num-kv-blocks", "256")
    out, md = tmp_path / "c.json", tmp_path / "R.md"
    a, b = UpProcess(*args, log_dir=tmp_path / "a"), UpProcess(*args, log_dir=tmp_path / "b")
    try:
        a.wait_ready(), b.wait_ready()
        extra = ("--self-pid", str(a.proc.pid), "--peer-pid", str(b.proc.pid), "--results-md", str(md))
        assert bench_cli(_argv(a.url, b.url, llama_dir, out, "--compare-rounds", "1", *extra)) == 0
    finally:
        codes = a.stop(), b.stop()
    assert codes == (0, 0), a.log()[-2000:] + b.log()[-2000:]
    doc = json.loads(out.read_text())
    assert doc["failed_requests"] == 0 and len(doc["passes"]) == 4
    for p in doc["passes"]:
        assert p["cache"]["counter_hit_tokens"] == 0 and p["cache"]["reporting"] == 5
        assert p["server_prompt_tokens_mean"] == 128  # the server's own count of the text
        assert p["summary"]["total_output_tokens"] == 4 * 64  # ignore_eos
        assert p["figures"]["peak_rss_bytes"] > 200e6  # router + stage, each importing torch
    _check_arithmetic(doc)
    rss = doc["aggregate"]["cells"]["p128-c16-o64"]["peak_rss_bytes"]["ratio"]
    assert 0.5 < rss < 2.0  # two trees of the same shape
    assert "| p128-c1-o64 |" in md.read_text() and "counter delta 0" in md.read_text()
