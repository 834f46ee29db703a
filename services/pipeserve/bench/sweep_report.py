"""A sweep's runs -> medians with their spread, ratios self ÷ peer, and the markdown RESULTS.md cites.

Every figure of a cell is the median over the rounds of that server's passes, with the spread
(min–max) beside it; the ratio is self's median over the peer's, with the spread of the per-round
ratios (round r's self ÷ round r's peer). A ratio *misses* when pipeserve is worse: a rate
(throughput, prompt processing) below 1.0×, a time or a size (TTFT, TPOT, RSS, ready) above 1.0×;
misses print in bold. A cell where any pass failed a request shows FAILED instead of ratios: a
figure over a partial pass would mislead. Fewer than 3 rounds are marked as not medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pipeserve.bench.sweep import QUIET, SIDES

# (key, column label, higher is better, how a value prints)
FIGURES = (
    ("out_tok_s", "out tok/s", True, "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", False, "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", False, "{:.0f}"),
    ("tpot_p50_ms", "TPOT p50 ms", False, "{:.1f}"),
    ("pp_tok_s", "prompt tok/s (C=1)", True, "{:.0f}"),
    ("peak_rss_bytes", "peak RSS MiB", False, "MiB"),
)
SERVER_FIGURES = (("ready_s", "ready s", False, "{:.2f}"), ("peak_rss_bytes", "peak RSS MiB", False, "MiB"))
MIN_ROUNDS = 3


def spread(values: Sequence[float | None]) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def misses(ratio: float | None, higher_is_better: bool) -> bool:
    if ratio is None:
        return False
    return ratio < 1.0 if higher_is_better else ratio > 1.0


def _compare(by_side: dict[str, dict[int, float | None]], higher: bool) -> dict:
    """Spreads of each side's values (by round), the ratio of medians and the per-round ratios' spread."""
    out: dict = {side: spread(list(by_side[side].values())) for side in SIDES}
    a, b = out["self"], out["peer"]
    out["ratio"] = a["median"] / b["median"] if a and b and b["median"] else None
    paired: list[float | None] = []
    for r, v in by_side["self"].items():
        p = by_side["peer"].get(r)
        if v is not None and p:
            paired.append(v / p)
    out["ratio_spread"] = spread(paired)
    out["miss"] = misses(out["ratio"], higher)
    return out


def aggregate(record: dict) -> dict:
    """{"cells": {key: {"failed": n, figure: comparison}}, "servers": {launch: {figure: comparison}}}."""
    cells: dict[str, dict] = {}
    for key in record["cells"]:
        passes = [p for p in record["passes"] if p["cell"] == key]
        if not passes:
            continue
        entry: dict = {"failed": sum(p["failed"] for p in passes)}
        for fig, _, higher, _ in FIGURES:
            by_side: dict[str, dict[int, float | None]] = {s: {} for s in SIDES}
            for p in passes:
                by_side[p["side"]][p["round"]] = p["figures"][fig]
            entry[fig] = _compare(by_side, higher)
        cells[key] = entry
    servers: dict[str, dict] = {}
    sessions = record["sessions"]
    # Each side's sessions by launch order within a round: the first launch of each side is its
    # headline (the default flags); ratios pair self's and the peer's first, second, ... launches.
    for fig, _, higher, _ in SERVER_FIGURES:
        per_side: dict[str, dict[int, float | None]] = {s: {} for s in SIDES}
        for s in sessions:
            firsts = [x for x in sessions if x["side"] == s["side"] and x["round"] == s["round"]]
            if s is firsts[0]:
                per_side[s["side"]][s["round"]] = s.get(fig)
        servers[fig] = _compare(per_side, higher)
    return {"cells": cells, "servers": servers}


def _value(v: float | None, fmt: str) -> str:
    if v is None:
        return "n/a"
    return f"{v / 2**20:,.0f}" if fmt == "MiB" else fmt.format(v)


def _spread_text(s: dict | None, fmt: str) -> str:
    if s is None:
        return "n/a"
    if s["n"] == 1:
        return _value(s["median"], fmt)
    return f"{_value(s['median'], fmt)} [{_value(s['min'], fmt)}–{_value(s['max'], fmt)}]"


def ratio_text(c: dict) -> str:
    r = c["ratio"]
    if r is None:
        return "n/a"
    text = f"{r:.2f}×"
    return f"**{text}**" if c["miss"] else text


def ratio_table(agg: dict) -> list[str]:
    head = "| cell | " + " | ".join(label for _, label, _, _ in FIGURES) + " |"
    lines = [head, "|---|" + "---:|" * len(FIGURES)]
    for key, entry in agg["cells"].items():
        if entry["failed"]:
            cells = [f"FAILED ({entry['failed']} requests)"] + [""] * (len(FIGURES) - 1)
        else:
            cells = [ratio_text(entry[fig]) for fig, _, _, _ in FIGURES]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def detail_table(agg: dict) -> list[str]:
    lines = [
        "| cell | figure | self: median [min–max] | peer: median [min–max] | self ÷ peer [per-round] |",
        "|---|---|---:|---:|---:|",
    ]
    for key, entry in agg["cells"].items():
        for fig, label, _, fmt in FIGURES:
            c = entry[fig]
            if c["self"] is None and c["peer"] is None:
                continue
            rs = c["ratio_spread"]
            per_round = "" if rs is None or rs["n"] < 2 else f" [{rs['min']:.2f}–{rs['max']:.2f}]"
            row = [key, label, _spread_text(c["self"], fmt), _spread_text(c["peer"], fmt)]
            lines.append("| " + " | ".join(row) + f" | {ratio_text(c)}{per_round} |")
    return lines


def server_table(agg: dict) -> list[str]:
    lines = ["| server (its first launch each round) | self | peer | self ÷ peer |", "|---|---:|---:|---:|"]
    for fig, label, _, fmt in SERVER_FIGURES:
        c = agg["servers"][fig]
        lines.append(
            f"| {label} | {_spread_text(c['self'], fmt)} | {_spread_text(c['peer'], fmt)} | {ratio_text(c)} |"
        )
    return lines


def cache_line(record: dict) -> str:
    """What the cache check saw over every pass, per side."""
    parts = []
    for side in SIDES:
        ps = [p for p in record["passes"] if p["side"] == side]
        hits = sum(p["cache"]["hit_tokens"] for p in ps)
        reporting = sum(p["cache"]["reporting"] for p in ps)
        counters = [p["cache"]["counter_hit_tokens"] for p in ps]
        counted = "n/a" if any(c is None for c in counters) else f"{sum(counters):g}"
        parts.append(
            f"{side}: {hits} cached prompt tokens in {reporting} responses reporting; counter delta {counted}"
        )
    return "; ".join(parts)


def quiet_line(record: dict) -> str | None:
    """How much CPU other processes took during the passes; None where it was not measured."""
    shares = [p.get("foreign_cpu_share") for p in record["passes"]]
    known = [s for s in shares if s is not None]
    if not known:
        return None
    loud = [s for s in known if s > QUIET]
    line = f"other processes' share of the CPUs during a pass: median {statistics.median(known):.1%}, "
    line += f"max {max(known):.1%}"
    if loud:
        line += f" — **machine not quiet in {len(loud)} of {len(known)} passes** (over {QUIET:.0%})"
    return line


def markdown(record: dict, agg: dict, plot: str | None = None) -> str:
    """The section `--results-md` appends: what ran where, with which commands, and the tables."""
    cpu = record["cpu"]
    rounds = record["rounds"]
    lines = [f"## Side-by-side: {record['label']}", ""]
    lines += [
        f"- date: {record['date']}, commit {record['commit']}",
        f"- CPU: {cpu['model']}, {cpu['cpus']} CPUs usable; flags: {', '.join(cpu['flags']) or 'none'}",
        f"- sweep: {record['sweep']} ({len(agg['cells'])} cells), {rounds} rounds alternating self, peer"
        + ("" if rounds >= MIN_ROUNDS else f" — **{rounds} round(s): not medians, wiring only**"),
        f"- prompts: {record['prompt_kind']}, fresh in every pass (seed {record['seed']}; first tokens "
        f"reused only {record['reuse_distance']} prompts apart; {record['prompts_issued']} prompts)",
        f"- cache check: {cache_line(record)}",
    ]
    if quiet := quiet_line(record):
        lines.append(f"- {quiet}")
    for side in SIDES:
        lines.append(f"- {side}: {record['servers'][side]['describe']}")
    alone = record.get("one_at_a_time")
    lines += ["", "Commands" + (" (each server alone on the machine while it runs):" if alone else ":"), ""]
    for side in SIDES:
        launches = record["servers"][side].get("commands", {})
        if len(launches) > 1:
            lines += [
                f"{side} was started {len(launches)} ways: a cell its first flags do not fit (more requests "
                "in flight than slots, or a longer request than a slot holds) gets its own launch.",
                "",
            ]
    lines += ["```sh"]
    lines += [record["command"]] if record.get("command") else []
    for side in SIDES:
        for key, argv in record["servers"][side].get("commands", {}).items():
            lines.append(f"# {side} [{key}]\n" + " ".join(argv))
    lines += ["```", "", f"Ratios self ÷ peer of medians over {rounds} runs (**bold**: a miss):", ""]
    lines += [*ratio_table(agg), "", *server_table(agg), ""]
    if plot:
        lines += [f"![ratios]({plot})", ""]
    lines += ["<details><summary>Every figure: median [min–max]</summary>", "", *detail_table(agg), ""]
    lines += ["</details>", ""]
    return "\n".join(lines)
