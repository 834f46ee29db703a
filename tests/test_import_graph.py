"""The package layering, read from the source (every import, lazy ones included).

* No import cycle between modules of `services/pipeserve`, nor between its packages.
* The engine is handed its executor: `engine/` imports nothing from the process roles and
  their layers (ring, care, stage, router, supervisor, entrypoints, cli), nor does `worker/`.
* Deciding and executing sides (issue 22): `engine/` (stage 0's scheduler, block manager, requests,
  plans) imports nothing from `worker/` (model runner, sampler, KV pool, the local executor): the
  worker implements engine/executor.py's contract and is handed in. `worker/` sees of `engine/` only
  the contract: plan.py (the messages), executor.py (the Executor protocol, BusyMeter) and
  grammar.py (the GrammarBook both sides compile specs with).
* A stage's runner is built in one place with everything it uses (worker/build.py): no module sets
  an attribute on a runner after construction (`runner.x = ...`, `stage.runner.x = ...`).
* The ring is below the stage process: `ring/` imports nothing from stage 0's front (stage),
  process care (care) or the roles above them. The stage is assembled above it (stage/assemble.py).
* HiCache's tiers are handed to a runner (worker/cache_moves.py's contract): `hicache/` imports
  nothing of `worker/` (what both sides share is engine/executor.py's), nor of the process roles.
* Nothing reaches through an executor to its runner (`executor.runner`, `x.executor.runner.tiers`):
  an executor is the Executor contract; what a caller needs of a stage it gets from the assembly.
* The operator imports only the policy side of process care: nothing of the local launch side
  (`local/`: launcher, redis-server), and not the CLI (`pipeserve stage`'s flags are
  stage_flags.py's) — directly or through what it imports, lazily too.
* The router needs only the tokenizer files, never the weights: it imports nothing that
  runs a model (engine, worker, model, ring, stage) — what `pipeserve router` on its own will rely on.
* Inside the router a request's way points one way: errors <- features/ <- api/ <- upstream/ <- http/
  (a module imports only its own layer and earlier ones).
* The router's and the operator's images have no torch, safetensors or transformers: no module those
  processes load imports one of them at module level, directly or through the modules it imports at
  module level (function bodies and `if TYPE_CHECKING:` blocks do not run on import). The modules they
  load: every module of `router/` and of the operator, whatever those import (lazily too: they run it
  while serving), and the CLI's parser (`pipeserve`, cli, supervisor.up, bench.serving, config, ...).
  A live check of the same rule: tests/k8s/test_images.py runs those processes without torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Each package in a folder named as it is imported: services/pipeserve, operator/pipeserve_operator,
# kernels/pipeserve_kernels.
ROOTS = (REPO / "services", REPO / "operator", REPO / "kernels")
PACKAGES = ("pipeserve", "pipeserve_operator", "pipeserve_kernels")
ROLES = ("ring", "care", "local", "stage", "router", "supervisor", "entrypoints", "cli")


def _modules() -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
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


def test_the_checker_walks_every_package() -> None:
    """The three packages, each under the folder named as it is imported, are all in the graph."""
    mods = _modules()
    for package in PACKAGES:
        assert package in mods, f"{package}: no __init__.py under {[str(r) for r in ROOTS]}"
        assert any(m.startswith(package + ".") for m in mods), package
    assert "pipeserve_kernels.reference" in mods and "pipeserve_operator.crd" in mods


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


@pytest.mark.parametrize("package", ["pipeserve.engine", "pipeserve.worker"])
def test_engine_imports_no_process_role(package: str) -> None:
    bad = {t for t in _imports_of(package) if t.split(".")[1] in ROLES}
    assert bad == set(), f"{package} imports {sorted(bad)}: hand it what it needs instead"


def test_engine_imports_no_worker() -> None:
    """The deciding side never imports the executing side: it is handed an Executor."""
    assert "pipeserve.worker.model_runner" in _modules()  # the checker sees the worker package
    bad = {t for t in _imports_of("pipeserve.engine") if _package(t) == "pipeserve.worker"}
    assert bad == set(), f"engine/ imports {sorted(bad)}: take it through the Executor contract"


# What worker/ may import from engine/: the contract, never the scheduler's state.
ENGINE_CONTRACT = {"pipeserve.engine.plan", "pipeserve.engine.executor", "pipeserve.engine.grammar"}


def test_worker_sees_only_the_engine_contract() -> None:
    bad = {t for t in _imports_of("pipeserve.worker") if _package(t) == "pipeserve.engine"} - ENGINE_CONTRACT
    assert bad == set(), f"worker/ imports {sorted(bad)} of engine/: only {sorted(ENGINE_CONTRACT)}"


def test_ring_is_below_the_stage_process() -> None:
    above = ("care", "local", "stage", "router", "supervisor", "entrypoints", "cli")
    bad = {t for t in _imports_of("pipeserve.ring") if t.split(".")[1] in above}
    assert bad == set(), f"ring/ imports {sorted(bad)}"


def test_hicache_imports_no_worker_nor_role() -> None:
    assert "pipeserve.hicache.stage_tiers" in _modules()  # the checker sees the package
    bad = {t for t in _imports_of("pipeserve.hicache") if t.split(".")[1] in ("worker", *ROLES)}
    assert bad == set(), f"hicache/ imports {sorted(bad)}: share it through engine/executor.py"


def executor_reach_throughs(source: str) -> list[str]:
    """Reads of an executor's runner: `executor.runner`, `<anything>.executor.runner` (and so any
    attribute chain beyond it, `engine.executor.runner.tiers`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "runner":
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id.endswith("executor")) or (
                isinstance(owner, ast.Attribute) and owner.attr.endswith("executor")
            ):
                found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def test_nothing_reaches_through_an_executor() -> None:
    sample = (
        "t = executor.runner.tiers\nm = engine.executor.runner\nr = stage.runner.meter\nx = self.runner\n"
    )
    assert executor_reach_throughs(sample) == ["line 1: executor.runner", "line 2: engine.executor.runner"]
    bad = {m: w for m, path in _modules().items() if (w := executor_reach_throughs(path.read_text()))}
    assert bad == {}, f"take it from the stage's assembly (stage/assemble.py), not the executor: {bad}"


def test_router_runs_no_model() -> None:
    bad = {
        t
        for t in _imports_of("pipeserve.router")
        if t.split(".")[1] in ("engine", "worker", "model", "ring", "stage")
    }
    assert bad == set(), f"router/ imports {sorted(bad)}"


# A request's way through the router, one direction (docs/architecture.md, "The router's way"): the
# shared errors module, then features/ (structured, tools, ...), api/ (parse, format), upstream/
# (fan-out, pick a group, stream) and http/ (the edge, the handlers that run the steps in order).
ROUTER_LAYERS = ("errors", "features", "api", "upstream", "http")


def router_upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each router module importing a router module of a later layer (or outside all)."""

    def layer(module: str) -> int:
        part = module.split(".")[2] if module.count(".") >= 2 else ""
        return ROUTER_LAYERS.index(part) if part in ROUTER_LAYERS else len(ROUTER_LAYERS)

    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.startswith("pipeserve.router.")
        for t in targets
        if t.startswith("pipeserve.router.") and layer(t) > layer(m)
    )


def test_router_layers_point_one_way() -> None:
    graph = import_graph()
    router = [m for m in graph if m.startswith("pipeserve.router.")]
    stray = [m for m in router if m.split(".")[2] not in ROUTER_LAYERS]
    assert stray == [], f"every router module is in one of {ROUTER_LAYERS}: {stray}"
    assert router_upward_imports(graph) == [], "a router layer imports a later one"
    sample = {"pipeserve.router.api.protocol": {"pipeserve.router.http.edge", "pipeserve.router.errors"}}
    assert router_upward_imports(sample) == ["pipeserve.router.api.protocol -> pipeserve.router.http.edge"]


def reachable(graph: dict[str, set[str]], starts: set[str]) -> set[str]:
    """Every module imported from `starts`, directly or through others (lazy imports included)."""
    seen, todo = set(starts), list(starts)
    while todo:
        for t in graph[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


def test_operator_imports_neither_the_cli_nor_the_local_launch_side() -> None:
    graph = import_graph()
    loaded = reachable(graph, {m for m in graph if m.startswith("pipeserve_operator")})
    assert "pipeserve.care.restarts" in loaded and "pipeserve.stage_flags" in loaded  # the graph sees them
    bad = {
        m for m in loaded if m == "pipeserve.cli" or m.startswith(("pipeserve.local", "pipeserve.supervisor"))
    }
    assert bad == set(), f"the operator reaches {sorted(bad)}"


def test_the_checker_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def runner_attribute_writes(source: str) -> list[str]:
    """`runner.x = ...` (or `<anything>.runner.x = ...`) assignments in a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign | ast.AugAssign)
            else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and (
                (isinstance(t.value, ast.Name) and t.value.id == "runner")
                or (isinstance(t.value, ast.Attribute) and t.value.attr == "runner")
            ):
                found.append(f"line {t.lineno}: {ast.unparse(t)}")
    return found


def test_no_runner_attribute_set_after_construction() -> None:
    sample = "runner = R()\nrunner.tiers = t\nself.runner.grammar = g\nself.runner = r\n"
    assert runner_attribute_writes(sample) == [
        "line 2: runner.tiers",
        "line 3: self.runner.grammar",
    ]
    bad = {m: w for m, path in _modules().items() if (w := runner_attribute_writes(path.read_text()))}
    assert bad == {}, f"pass it to worker/build.py's build_runner instead: {bad}"


# --- what the router's and the operator's processes load imports no torch at module level ---

HEAVY = ("torch", "safetensors", "transformers")  # not in the router and operator images (docker/)
# Loaded by `pipeserve router` and `pipeserve-operator` (the operator builds `pipeserve stage`'s parser,
# stage_flags.py, to check engine flags): these, every module of the two packages below,
# and every module those packages import, lazily too.
LIGHT_MODULES = (
    "pipeserve",
    "pipeserve.cli",
    "pipeserve.config",
    "pipeserve.tokenizer",
    "pipeserve.care.restarts",
    "pipeserve.stage_flags",
    "pipeserve.supervisor.up",
    "pipeserve.bench.serving",
    "pipeserve.model.demo_spec",
)
LIGHT_PACKAGES = ("pipeserve.router", "pipeserve_operator")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_time_imports(source: str) -> set[str]:
    """Every name imported when the module is imported: its top level, class bodies, if/try/with blocks;
    not function bodies (they run when called) nor `if TYPE_CHECKING:` (false at run time)."""
    out: set[str] = set()

    def visit(nodes: list) -> None:
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(source).body)
    return out


def heavy_chains(sources: dict[str, str]) -> dict[str, list[str]]:
    """Module -> the chain of import-time imports that reaches torch (or safetensors, transformers), for
    every module that has one. Importing a.b.c runs a and a.b first: parents count as imported."""

    def with_parents(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]

    edges: dict[str, list[str]] = {}
    for name, src in sources.items():
        targets = {p for t in import_time_imports(src) for p in with_parents(t)} | set(with_parents(name))
        edges[name] = sorted(t for t in targets if t != name and (t in sources or t.split(".")[0] in HEAVY))
    chains: dict[str, list[str] | None] = {}

    def chain(m: str) -> list[str] | None:
        if m.split(".")[0] in HEAVY:
            return [m]
        if m not in chains:
            chains[m] = None  # in progress: a cycle back here adds nothing
            for t in edges[m]:
                if (rest := chain(t)) is not None:
                    chains[m] = [m, *rest]
                    break
        return chains[m]

    return {m: c for m in sources if (c := chain(m)) is not None}


def light_modules(graph: dict[str, set[str]]) -> set[str]:
    """The modules the router's and the operator's processes load (see LIGHT_MODULES)."""
    inside = {m for m in graph if m.startswith(LIGHT_PACKAGES)}
    return set(LIGHT_MODULES) | inside | {t for m in inside for t in graph[m]}


def test_router_and_operator_import_no_torch() -> None:
    graph = import_graph()
    light = light_modules(graph)
    assert "pipeserve_operator.resources" in light and "pipeserve.router.http.app" in light  # graph sees them
    chains = heavy_chains({m: path.read_text() for m, path in _modules().items()})
    assert "pipeserve.ring.group" in chains  # the checker sees torch where it is
    bad = {m: " -> ".join(chains[m]) for m in sorted(light) if m in chains}
    assert bad == {}, f"imports torch (or safetensors, transformers) at module level: {bad}"


def test_the_checker_sees_a_module_level_torch_import() -> None:
    sources = {
        "p": "",
        "p.heavy": "import torch\n",
        "p.via_parent": "",  # its parent p imports nothing heavy
        "p.chain": "from p.mid import x\n",
        "p.mid": "try:\n    from safetensors.torch import save_file\nexcept ImportError:\n    pass\n",
        "p.lazy": "def f():\n    import torch\n",
        "p.typing": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        "p.cls": "class A:\n    from p.heavy import x\n",
        "q": "import p.heavy\n",
        "q.child": "",  # importing q.child runs q, which imports torch
    }
    chains = heavy_chains(sources)
    assert chains == {
        "p.heavy": ["p.heavy", "torch"],
        "p.chain": ["p.chain", "p.mid", "safetensors"],
        "p.mid": ["p.mid", "safetensors"],
        "p.cls": ["p.cls", "p.heavy", "torch"],
        "q": ["q", "p.heavy", "torch"],
        "q.child": ["q.child", "q", "p.heavy", "torch"],
    }
