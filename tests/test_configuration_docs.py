"""docs/configuration.md is generated from the fields' declarations and fresh; no default of a config
field is declared a second time by hand beside its flag."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import MISSING, fields
from pathlib import Path

from pipeserve.config import CONFIGS, SupervisorConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PACKAGE = ROOT / "services" / "pipeserve" / "config"
# Flags named like a config field that mean something else there: `pipeserve bench --seed` seeds the
# benchmark's prompts, not the engine.
OTHER_MEANING = {("services/pipeserve/bench/serving.py", "--seed")}


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_are_fresh() -> None:
    text = _generator().render()
    assert (ROOT / "docs" / "configuration.md").read_text() == text, (
        "docs/configuration.md is stale: run .venv/bin/python scripts/gen_config_docs.py"
    )


def test_docs_list_every_user_facing_flag_and_no_internal_one() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    for cls in CONFIGS:
        prefix = "supervisor-" if cls is SupervisorConfig else ""
        for f in fields(cls):
            if f.metadata.get("internal"):
                assert f"| `--{prefix}{f.name.replace('_', '-')}` |" not in text, f"{cls.__name__}.{f.name}"
    assert "| `--max-num-seqs` | int | 256 |" in text and "| `--num-kv-blocks` |" not in text


def _field_flags() -> dict[str, object]:
    """--flag -> the declared default, of every config field."""
    out: dict[str, object] = {}
    for cls in CONFIGS:
        for f in fields(cls):
            flag = f.name.replace("_", "-")
            default = None if f.default is MISSING else f.default
            out["--" + flag] = out["--supervisor-" + flag] = default
    return out


def hand_declared_defaults(
    source: str, flags: dict[str, object], other: frozenset[str] = frozenset()
) -> list[str]:
    """add_argument calls for a config field's flag with a default written as a literal (`other`:
    flags that mean something else in this file)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        default = next((k.value for k in node.keywords if k.arg == "default"), None)
        if (
            any(n in flags and n not in other for n in names)
            and isinstance(default, ast.Constant)
            and default.value is not None
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scanner_finds_a_second_declaration() -> None:
    sample = (
        'p.add_argument("--drain-timeout-s", type=float, default=30.0)\n'
        'p.add_argument("--replicas", type=int, default=1)\n'  # not a config field
        'p.add_argument("--model", default=env.get(MODEL))\n'  # not a literal
    )
    assert [r.split(":")[0] for r in hand_declared_defaults(sample, _field_flags())] == ["line 1"]


def test_no_field_default_is_declared_twice() -> None:
    flags, bad = _field_flags(), {}
    for tree in (ROOT / "services" / "pipeserve", ROOT / "operator" / "pipeserve_operator"):
        for path in sorted(tree.rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            other = {flag for where, flag in OTHER_MEANING if where == rel}
            if CONFIG_PACKAGE not in path.parents and (
                hits := hand_declared_defaults(path.read_text(), flags, other)
            ):
                bad[rel] = hits
    assert bad == {}, f"take the flag from the field (config.add_config_args): {bad}"


def test_every_chart_value_named_exists() -> None:
    """A field's `chart` names a value of charts/pipeserve/values.yaml that sets the flag."""
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "pipeserve" / "values.yaml").read_text())
    named = [f.metadata["chart"] for cls in CONFIGS for f in fields(cls) if f.metadata.get("chart")]
    missing = []
    for path in named:
        node = values
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                missing.append(path)
                break
            node = node[key]
    assert named and missing == []
