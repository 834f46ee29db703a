"""The side-by-side's report: medians and spreads over rounds, ratios, misses in bold, the section, the plot.

Built from a record of known passes (what bench/sweep.py writes), so every printed number can be
worked out by hand here.
"""

from __future__ import annotations

import pytest

from pipeserve.bench import sweep_plot, sweep_report
from pipeserve.bench.host import cpu_info

CELLS = ["p128-c1-o64", "p128-c16-o64"]


def _pass(side: str, rnd: int, cell: str, out: float, ttft: float, failed: int = 0) -> dict:
    figures = {
        "out_tok_s": out,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft * 2,
        "tpot_p50_ms": 10.0,
        "pp_tok_s": 128 / ttft * 1000 if cell.endswith("c1-o64") else None,
        "peak_rss_bytes": (600 if side == "self" else 500) * 2**20,
    }
    cache = {"hit_tokens": 0, "reporting": 8, "counter_hit_tokens": 0 if side == "self" else None}
    return {"side": side, "round": rnd, "cell": cell, "figures": figures, "failed": failed, "cache": cache}


def record(rounds: int = 3, failed_cell: str | None = None) -> dict:
    passes = []
    for rnd in range(1, rounds + 1):
        for cell in CELLS:
            # self: throughput 90, 100, 110 (median 100) against the peer's steady 80 -> 1.25x, met;
            # TTFT 300, 200, 250 (median 250) against 200 -> 1.25x, a miss.
            passes.append(_pass("self", rnd, cell, 80.0 + 10 * rnd, (300.0, 200.0, 250.0)[(rnd - 1) % 3]))
            passes.append(_pass("peer", rnd, cell, 80.0, 200.0, failed=int(cell == failed_cell)))
    sessions = [
        {"side": s, "round": r, "launch": k, "ready_s": (4.0 if s == "self" else 1.0) + r / 10, "argv": None}
        for r in range(1, rounds + 1)
        for s in ("self", "peer")
        for k in (("np16-c16384", "np64-c65536") if s == "peer" else ("s2",))
    ]
    for s in sessions:
        s["peak_rss_bytes"] = (900 if s["side"] == "self" else 600) * 2**20
    return {
        "label": "test subject",
        "date": "today",
        "commit": "abc",
        "cpu": cpu_info(),
        "sweep": "reduced",
        "rounds": rounds,
        "cells": CELLS,
        "prompt_kind": "text",
        "seed": 7,
        "reuse_distance": 1244,
        "prompts_issued": 99,
        "command": "python benchmarks/peer.py compare --sweep reduced",
        "servers": {
            "self": {"describe": "pipeserve up", "commands": {"s2": ["pipeserve", "up", "--stages", "2"]}},
            "peer": {
                "describe": "llama-server",
                "commands": {"np16-c16384": ["llama-server", "-np", "16"], "np64-c65536": ["llama-server"]},
            },
        },
        "passes": passes,
        "sessions": sessions,
    }


def test_spread_and_misses():
    assert sweep_report.spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert sweep_report.spread([None]) is None
    assert sweep_report.misses(0.99, True) and not sweep_report.misses(1.0, True)
    assert sweep_report.misses(1.01, False) and not sweep_report.misses(0.5, False)
    assert not sweep_report.misses(None, True)


def test_aggregate_medians_spreads_and_ratios():
    agg = sweep_report.aggregate(record())
    out = agg["cells"]["p128-c16-o64"]["out_tok_s"]
    assert out["self"] == {"median": 100.0, "min": 90.0, "max": 110.0, "n": 3}
    assert out["ratio"] == pytest.approx(1.25) and not out["miss"]
    spread = out["ratio_spread"]
    assert spread["min"] == pytest.approx(90 / 80) and spread["max"] == pytest.approx(110 / 80)
    ttft = agg["cells"]["p128-c1-o64"]["ttft_p50_ms"]
    assert ttft["ratio"] == pytest.approx(1.25) and ttft["miss"]
    pp = agg["cells"]["p128-c1-o64"]["pp_tok_s"]
    assert pp["ratio"] == pytest.approx(200 / 250) and pp["miss"]  # a slower prompt rate misses
    assert agg["cells"]["p128-c16-o64"]["pp_tok_s"]["ratio"] is None  # only at C=1
    # Server figures: each side's first launch per round (the peer's np16, not its np64 restart).
    ready = agg["servers"]["ready_s"]
    assert ready["self"]["median"] == pytest.approx(4.2) and ready["peer"]["median"] == pytest.approx(1.2)
    assert ready["peer"]["n"] == 3 and ready["miss"]


def test_tables_bold_the_misses_and_mark_failed_cells():
    agg = sweep_report.aggregate(record(failed_cell="p128-c16-o64"))
    table = "\n".join(sweep_report.ratio_table(agg))
    row = next(line for line in table.splitlines() if line.startswith("| p128-c1-o64 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # out tok/s met (plain), TTFT p50 / p99 missed (bold), TPOT equal, prompt rate missed, RSS missed.
    assert cells[1:] == ["1.25×", "**1.25×**", "**1.25×**", "1.00×", "**0.80×**", "**1.20×**"]
    assert "| p128-c16-o64 | FAILED (3 requests) |" in table
    md = sweep_report.markdown(record(), sweep_report.aggregate(record()), "ratios.png")
    cpu = cpu_info()
    assert f"CPU: {cpu['model']}" in md and ", ".join(cpu["flags"]) in md
    assert "llama-server -np 16" in md and "pipeserve up --stages 2" in md and "peer.py compare" in md
    assert "![ratios](ratios.png)" in md and "1244 prompts apart" in md
    assert "peer was started 2 ways" in md and "# peer [np64-c65536]" in md
    assert "110.0]" in md  # the detail table's spread: 100.0 [90.0–110.0]
    assert "not medians" not in md
    assert "not medians" in sweep_report.markdown(record(1), sweep_report.aggregate(record(1)))


def test_ratio_plot_is_written(tmp_path):
    png = sweep_plot.write_ratio_plot(sweep_report.aggregate(record()), tmp_path / "r.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
