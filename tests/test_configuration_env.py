"""One module reads the environment: services/pipeserve/env.py declares every variable and is the only
module of services/ and operator/ that reads os.environ (the operator runs from the same installed
distribution, so it reads its variables there too) or writes a PIPESERVE_* name."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

from pipeserve import env as pipeserve_env
from pipeserve.config import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
TREES = (ROOT / "services" / "pipeserve", ROOT / "operator" / "pipeserve_operator")
ENV_MODULE = ROOT / "services" / "pipeserve" / "env.py"
NAME = re.compile(r"PIPESERVE_[A-Z0-9_]+")


def _is_environ(node: ast.expr) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def env_reads(source: str) -> list[str]:
    """Every read of the environment (os.environ.get/[]/in, os.getenv) and every PIPESERVE_* name
    written as a string of its own (a variable declared outside env.py), as 'line N: code'."""
    tree = ast.parse(source)
    docs, found = _docstrings(tree), []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            hit = (f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)) or f.attr == "getenv"
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            hit = _is_environ(node.value)
        elif isinstance(node, ast.Compare):
            hit = any(isinstance(o, ast.In | ast.NotIn) for o in node.ops) and any(
                _is_environ(c) for c in node.comparators
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            hit = bool(NAME.fullmatch(node.value))
        if hit:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")  # type: ignore[attr-defined]
    return found


def test_the_scanner_finds_every_kind_of_read() -> None:
    sample = (
        '"""PIPESERVE_HOME in a docstring is prose."""\n'
        "import os\n"
        'a = os.environ.get("X")\n'
        'b = os.environ["Y"]\n'
        'c = "Z" in os.environ\n'
        'd = os.getenv("W")\n'
        'NAME = "PIPESERVE_NEW"\n'
        'os.environ["V"] = "1"\n'  # a write (a launcher exporting to its children) is no read
        'e = dict(os.environ, V="1")\n'  # nor is a copy for a child process
        'f = f"set {NAME} or PIPESERVE_OTHER"\n'  # nor prose naming a variable
    )
    assert [r.split(":")[0] for r in env_reads(sample)] == ["line 3", "line 4", "line 5", "line 6", "line 7"]


def test_only_env_py_reads_the_environment() -> None:
    bad = {}
    for tree in TREES:
        for path in sorted(tree.rglob("*.py")):
            if path != ENV_MODULE and (reads := env_reads(path.read_text())):
                bad[str(path.relative_to(ROOT))] = reads
    assert bad == {}, f"read them through pipeserve.env (declare new variables there): {bad}"


def test_every_fields_variable_is_declared_in_env_py() -> None:
    named = {f.metadata["env"] for cls in CONFIGS for f in fields(cls) if f.metadata.get("env")}
    assert named and named <= set(pipeserve_env.VARS)
    assert all(v.help for v in pipeserve_env.VARS.values())


def test_home_default_is_applied_in_one_place(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(pipeserve_env.HOME, raising=False)
    monkeypatch.delenv(pipeserve_env.FLIGHT_DIR, raising=False)  # tests/conftest.py sets one
    assert pipeserve_env.home() == Path.home() / ".cache" / "pipeserve"
    monkeypatch.setenv(pipeserve_env.HOME, str(tmp_path))
    from pipeserve.model.default import pipeserve_home
    from pipeserve.obs.flight import default_directory

    assert pipeserve_home() == tmp_path and default_directory() == tmp_path / "flight"
    monkeypatch.setenv(pipeserve_env.HOME, "")  # empty: unset
    assert pipeserve_env.home() == Path.home() / ".cache" / "pipeserve"
