"""What the metrics tests share: docs/metrics.md as records, a live scrape as families, and the
dashboard's PromQL as metric names (parsed with promql_parser, never by regex).

Names: docs/metrics.md lists counters as `NAME_total` (what PromQL queries); the exposition parser
(prometheus_client.parser) names a counter's family `NAME`. `family_of` maps a queried series name
(`X_total`, `X_bucket`, `X_sum`, `X_count`, a gauge's own name) to the exported family it reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving_support import running_up

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "charts" / "pipeserve" / "dashboards" / "pipeserve.json"
PREFIX = "pipeserve:"
# Grafana's own variables, replaced by a value of their kind before the PromQL is parsed.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


@dataclass(frozen=True)
class Documented:
    name: str  # as queried: counters end in _total
    type: str  # counter, gauge, histogram
    labels: frozenset[str]
    process: str  # router, supervisor, stage 0, every stage
    when: str  # "-", "HiCache", "L2", "L3"

    @property
    def family(self) -> str:
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


@dataclass(frozen=True)
class Exported:
    type: str
    labels: frozenset[str]  # every label of its samples but `le`; empty when it has no sample yet


def documented(text: str | None = None) -> list[Documented]:
    """The table rows of docs/metrics.md whose first cell is a `pipeserve:` name."""
    rows = []
    for line in (DOC.read_text() if text is None else text).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6 or not cells[0].startswith(f"`{PREFIX}"):
            continue
        labels = frozenset(x.strip() for x in cells[2].split(",") if x.strip())
        rows.append(Documented(cells[0].strip("`"), cells[1], labels, cells[3], cells[4]))
    return rows


def parse_exposition(text: str) -> dict[str, Exported]:
    """family name -> type and labels, for every `pipeserve:` family (prometheus_client's `_created`
    companions skipped: they are the client library's, not ours)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(PREFIX) or fam.name.endswith("_created"):
            continue
        labels = {k for s in fam.samples for k in s.labels if k != "le"}
        out[fam.name] = Exported(fam.type, frozenset(labels))
    return out


def processes_of(doc: Documented) -> tuple[str, ...]:
    """The scrape keys (router, stage0, stage1) whose /metrics must carry `doc`."""
    return {
        "router": ("router",),
        "supervisor": ("router",),
        "stage 0": ("stage0",),
        "every stage": ("stage0", "stage1"),
    }[doc.process]


def mismatches(
    docs: list[Documented], scrapes: dict[str, dict[str, Exported]], conditions: set[str]
) -> list[str]:
    """Every disagreement between the documented table and the scrapes, both ways: a documented
    metric (whose condition holds) missing from, or of another type or labels in, a process that must
    export it; an exported `pipeserve:` family not documented for that process."""
    problems = []
    for d in docs:
        if d.when != "-" and d.when not in conditions:
            continue
        for proc in processes_of(d):
            got = scrapes[proc].get(d.family)
            if got is None:
                problems.append(f"{d.name}: documented for {d.process}, not exported by {proc}")
            elif got.type != d.type:
                problems.append(f"{d.name}: documented {d.type}, {proc} exports {got.type}")
            elif got.labels and got.labels != d.labels:
                problems.append(
                    f"{d.name}: documented labels {sorted(d.labels)}, {proc}: {sorted(got.labels)}"
                )
    for proc, fams in scrapes.items():
        allowed = {d.family for d in docs if proc in processes_of(d)}
        problems += [f"{proc} exports {name}, not documented for it" for name in fams if name not in allowed]
    return problems


def dashboard_exprs(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' nested panels included."""
    for panel in dashboard.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield inner.get("title", "?"), target["expr"]


def selectors(expr: str) -> list[str]:
    """The metric names of every vector selector in `expr`, from promql_parser's AST."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    names: list[str] = []

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name is None:
                raise AssertionError(f"a selector without a metric name in {expr!r}")
            names.append(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def family_of(series: str, exported: dict[str, Exported]) -> str | None:
    """The exported family a queried series name reads, or None if no exported family has it."""
    if series in exported and exported[series].type == "gauge":
        return series
    if (
        series.endswith("_total")
        and exported.get(series.removesuffix("_total"), Exported("", frozenset())).type == "counter"
    ):
        return series.removesuffix("_total")
    for suffix in ("_bucket", "_sum", "_count"):
        base = series.removesuffix(suffix)
        if series.endswith(suffix) and base in exported and exported[base].type == "histogram":
            return base
    return None


def unknown_in_dashboard(dashboard: dict, exported: dict[str, Exported]) -> list[str]:
    """`panel: series` for every series a panel queries that no running process exports."""
    return [
        f"{title}: {name}"
        for title, expr in dashboard_exprs(dashboard)
        for name in selectors(expr)
        if family_of(name, exported) is None
    ]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def misspell(dashboard: dict, name: str, wrong: str) -> dict:
    """A copy of `dashboard` with every `name` in its exprs replaced by `wrong` (whole names only)."""
    text = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", wrong, json.dumps(dashboard))
    return json.loads(text)


# One live `pipeserve up --stages 2` for the metrics and dashboard tests (started once per session, so
# tests/obs/test_metrics_names.py and tests/obs/test_dashboard.py read the same scrape); tests/conftest.py
# registers the fixture.
@dataclass(frozen=True)
class LiveScrape:
    scrapes: dict[str, dict[str, Exported]]  # "router", "stage0", "stage1" -> family -> Exported
    texts: dict[str, str]  # the raw exposition of each
    conditions: set[str]  # which of docs/metrics.md's `when` values hold in this run

    def exported(self) -> dict[str, Exported]:
        """Every family any process exports (what a dashboard may query)."""
        return {k: v for fams in self.scrapes.values() for k, v in fams.items()}


@pytest.fixture(scope="session")
def live_scrape(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveScrape]:
    args = ("--model", str(llama_dir), "--stages", "2", "--num-kv-blocks", "256")
    with running_up(*args, log_dir=tmp_path_factory.mktemp("up-metrics")) as up:
        prompt = list(range(10, 60))  # several full KV blocks, so the repeat hits the prefix cache
        body = {"model": str(llama_dir), "prompt": prompt, "max_tokens": 6, "temperature": 0}
        for stream in (False, True, True):  # the same prompt again: a prefix-cache hit
            r = httpx.post(up.url + "/v1/completions", json={**body, "stream": stream}, timeout=60)
            assert r.status_code == 200, r.text
        assert httpx.get(up.url + "/v1/nope", timeout=5).status_code == 404
        (group,) = up.groups()
        urls = {"router": up.url, "stage0": group["health"][0], "stage1": group["health"][1]}
        texts = {k: httpx.get(u + "/metrics", timeout=10).text for k, u in urls.items()}
        conditions = {"HiCache", "L2"}  # `up`'s defaults: an L2 pool per stage
        if "L3: private redis-server" in up.log():
            conditions.add("L3")
        yield LiveScrape({k: parse_exposition(t) for k, t in texts.items()}, texts, conditions)
