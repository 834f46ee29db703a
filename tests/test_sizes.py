"""Files and functions stay a size a reader can hold (issue 30, point 6).

Every product module (services/, operator/, kernels/; generated protobuf code aside) is at most
400 lines, and every function or method in it at most 60 lines, decorators and docstring included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("services", "operator", "kernels")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    files = [p for d in PRODUCT for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if "_pb2" not in p.name and ".egg-info" not in str(p)]


def test_the_product_is_found() -> None:
    assert len(_modules()) > 150  # the scan reads the tree it should (a moved folder fails here)


def test_no_product_file_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, long


def test_no_function_over_60_lines() -> None:
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - first + 1) > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert not long, long
