"""`pipeserve bench --compare`: the same workload against two servers, and ratios that follow from the runs.

The live test runs two real `pipeserve up` servers on the demo model (the second stands in for the
peer, e.g. llama.cpp's llama-server, which tests do not build); the others use the stand-in
OpenAI app of test_bench.py (known sleeps) and a real process tree for the RSS sum.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bench import Served, bench_cli, openai_app

from pipeserve.bench import compare, workloads
from serving_support import UpProcess

pytestmark = pytest.mark.timeout(180)


def _small(url: str, peer: str, out: Path, *extra: str) -> list[str]:
    argv = ["bench", "--url", url, "--compare", peer, "--num-requests", "8", "--concurrency", "4"]
    argv += ["--input-len", "24", "--range-ratio", "0.5", "--output-len", "6", "--warmup", "1"]
    return [*argv, "--single-stream-requests", "2", "--json", str(out), *extra]


def _check_arithmetic(doc: dict, keys: tuple[str, ...] = tuple(k for k, _, _ in compare.FIGURES)) -> None:
    """Figures are the medians of the rounds' passes; every ratio is self's figure over the peer's."""
    for side in compare.SIDES:
        rounds, fig = doc[side]["rounds"], doc[side]["figures"]
        assert fig["out_tok_s"] == pytest.approx(
            sorted(r["serving"]["output_throughput"] for r in rounds)[len(rounds) // 2]
        )
        assert fig["ttft_p50_ms"] == pytest.approx(
            sorted(r["serving"]["ttft_ms"]["p50"] for r in rounds)[len(rounds) // 2]
        )
        assert fig["single_tok_s"] == pytest.approx(
            sorted(r["single"]["output_throughput"] for r in rounds)[len(rounds) // 2]
        )
    for key in keys:
        a, b = doc["self"]["figures"][key], doc["peer"]["figures"][key]
        assert doc["ratios"][key] == pytest.approx(a / b), key


def test_compare_ratios_follow_from_the_runs_stand_ins(tmp_path, capsys):
    """Self answers 10x slower to the first token than the peer (200 vs 20 ms): the TTFT ratio says
    self is slower, every ratio is the figures divided, and a peer that fails requests fails the run."""
    slow, _ = openai_app(ttft=0.20, itl=0.002)
    fast, fast_state = openai_app(ttft=0.02, itl=0.002)
    out = tmp_path / "c.json"
    with Served(slow) as a, Served(fast) as b:
        assert bench_cli(_small(a.url, b.url, out, "--compare-rounds", "3")) == 0
    doc = json.loads(out.read_text())
    # Each round: 1 warmup + 8 timed + 2 single-stream requests, identical prompts on both sides.
    assert fast_state["count"] == 3 * 11
    assert len(doc["self"]["rounds"]) == len(doc["peer"]["rounds"]) == 3
    assert doc["failed_requests"] == 0 and doc["self"]["pid"] is None
    _check_arithmetic(doc, ("out_tok_s", "ttft_p50_ms", "single_tok_s"))
    assert doc["ratios"]["peak_rss_bytes"] is None  # no pids given: not measured
    # Only the direction is checked: on a loaded machine both TTFTs grow by the same ~0.1 s.
    assert doc["ratios"]["ttft_p50_ms"] > 1.5
    text = capsys.readouterr().out
    assert f"{doc['ratios']['ttft_p50_ms']:.3f}x" in text and "Compare: self = --url" in text

    failing, _ = openai_app(ttft=0.01, fail_every=3)
    with Served(fast) as a, Served(failing) as b:
        assert bench_cli(_small(a.url, b.url, out)) == 1
    assert json.loads(out.read_text())["failed_requests"] > 0
    assert "FAILED requests" in capsys.readouterr().out


def test_compare_rejects_other_modes_and_missing_pids():
    with pytest.raises(ValueError, match="--router-overhead"):
        bench_cli(["bench", "--compare", "http://h:1", "--router-overhead", "--grpc", "h:2"])
    with pytest.raises(ValueError, match="no such process"):
        bench_cli(["bench", "--compare", "http://h:1", "--peer-pid", "999999999"])
    with pytest.raises(ValueError, match="--compare-rounds"):
        bench_cli(["bench", "--compare", "http://h:1", "--compare-rounds", "0"])


def test_tree_peak_rss_sums_every_descendant():
    """A parent with two children, one of which holds ~64 MB: the tree sum counts all three."""
    child = "import time; b = b'x' * (64 << 20); time.sleep(30)"  # written bytes: resident
    spawn = f"subprocess.Popen([sys.executable, '-c', {child!r}])"
    script = f"import subprocess, sys, time; ps = [{spawn} for _ in 'ab']"
    root = subprocess.Popen([sys.executable, "-c", script + "; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while len(compare.tree_pids(root.pid)) < 3:
            assert time.monotonic() < deadline, "children did not start"
            time.sleep(0.05)
        pids = compare.tree_pids(root.pid)
        time.sleep(0.5)  # the children allocate
        total = compare.tree_peak_rss(root.pid)
        assert total == pytest.approx(sum(compare.status_bytes(p, "VmHWM") for p in pids), rel=0.05)
        assert total >= 2 * (64 << 20) + compare.status_bytes(root.pid, "VmHWM")
    finally:
        for pid in compare.tree_pids(root.pid)[::-1]:
            subprocess.run(["kill", str(pid)], check=False)
        root.wait(timeout=10)
    assert compare.tree_pids(root.pid) == []


@pytest.mark.slow
def test_compare_two_live_pipeserve_servers(llama_dir, tmp_path, capsys):
    """Two real `pipeserve up` (S=1): both complete the same workload, the RSS figure sums the whole
    process tree (router + stage), and the printed and JSON ratios are the runs' own figures divided."""
    args = ("--model", str(llama_dir), "--stages", "1", "--num-kv-blocks", "256")
    out, md = tmp_path / "c.json", tmp_path / "R.md"
    # Both start at once (start-up is most of this test's time); each must stop cleanly.
    a, b = UpProcess(*args, log_dir=tmp_path / "a"), UpProcess(*args, log_dir=tmp_path / "b")
    try:
        a.wait_ready(), b.wait_ready()
        stage_pids = [p for g in a.pids().values() for p in g.values()]
        extra = ("--self-pid", str(a.proc.pid), "--peer-pid", str(b.proc.pid), "--tokenizer", str(llama_dir))
        assert bench_cli(_small(a.url, b.url, out, *extra, "--results-md", str(md))) == 0
        tree = compare.tree_pids(a.proc.pid)
        assert set(stage_pids) <= set(tree) and len(tree) >= 2
    finally:
        codes = a.stop(), b.stop()
    assert codes == (0, 0), a.log()[-2000:] + b.log()[-2000:]
    doc = json.loads(out.read_text())
    assert doc["failed_requests"] == 0
    assert doc["self"]["model"] == doc["peer"]["model"] == str(llama_dir)
    s_self, s_peer = doc["self"]["rounds"][0]["serving"], doc["peer"]["rounds"][0]["serving"]
    assert s_self["completed"] == s_peer["completed"] == 8
    assert s_self["total_input_tokens"] == s_peer["total_input_tokens"]  # the same prompts
    vocab = workloads.resolve_vocab_size(None, str(llama_dir))
    drawn = sum(r.output_len for r in workloads.random_workload(8, 24, 6, 0.5, vocab, seed=0))
    assert s_self["total_output_tokens"] == s_peer["total_output_tokens"] == drawn  # ignore_eos
    _check_arithmetic(doc)
    # Two trees of the same shape (router + one stage, each importing torch): the ratio is near 1.
    assert doc["self"]["figures"]["peak_rss_bytes"] > 200e6
    assert 0.5 < doc["ratios"]["peak_rss_bytes"] < 2.0
    text = capsys.readouterr().out
    for key in ("out_tok_s", "ttft_p50_ms", "single_tok_s", "peak_rss_bytes"):
        assert f"{doc['ratios'][key]:.3f}x" in text
    assert "| Output tok/s (serving pass) |" in md.read_text() and "--compare" in md.read_text()
