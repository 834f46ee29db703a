"""The package layering, read from the source (every import, lazy ones included).

* No import cycle between modules of `services/pipeserve`, nor between its packages.
* The engine is handed its executor: `engine/` imports nothing from the process roles and
  their layers (ring, care, stage, router, supervisor, entrypoints, cli).
* The ring is below the stage process: `ring/` imports nothing from stage 0's front (stage),
  process care (care) or the roles above them.
* The router needs only the tokenizer files, never the weights: it imports nothing that
  runs a model (engine, model, ring, stage) — what `pipeserve router` on its own will rely on.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "services"
ROLES = ("ring", "care", "stage", "router", "supervisor", "entrypoints", "cli")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the pipeserve modules it imports (`from a.b import c` counts a.b.c when it is a module)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    graph[name].add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names)
        graph[name] = {t for t in graph[name] if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                found.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_modules() -> None:
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_packages() -> None:
    packages: dict[str, set[str]] = {}
    for m, targets in import_graph().items():
        packages.setdefault(_package(m), set()).update(
            _package(t) for t in targets if _package(t) != _package(m)
        )
    for targets in packages.values():
        for t in targets:
            packages.setdefault(t, set())
    assert cycles(packages) == []


def _imports_of(package: str) -> set[str]:
    return {t for m, ts in import_graph().items() if _package(m) == package for t in ts}


def test_engine_imports_no_process_role() -> None:
    bad = {t for t in _imports_of("pipeserve.engine") if t.split(".")[1] in ROLES}
    assert bad == set(), f"engine/ imports {sorted(bad)}: hand it what it needs instead"


def test_ring_is_below_the_stage_process() -> None:
    above = ("care", "stage", "router", "supervisor", "entrypoints", "cli")
    bad = {t for t in _imports_of("pipeserve.ring") if t.split(".")[1] in above}
    assert bad == set(), f"ring/ imports {sorted(bad)}"


def test_router_runs_no_model() -> None:
    bad = {
        t for t in _imports_of("pipeserve.router") if t.split(".")[1] in ("engine", "model", "ring", "stage")
    }
    assert bad == set(), f"router/ imports {sorted(bad)}"


def test_the_checker_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
