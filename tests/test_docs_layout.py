"""The layout the docs give is the tree's: README.md's layout table and docs/architecture.md's
package table name every package of `services/pipeserve` and nothing else; their test rows name
every test folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "services" / "pipeserve"


def _folders(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}


def _named(text: str) -> set[str]:
    """Folders named as `name/` or `parent/name/` (the last part)."""
    return set(re.findall(r"`(?:[a-z0-9_]+/)*([a-z0-9_]+)/`", text))


def _row(text: str, head: str) -> str:
    """The cells after the first of the table row that starts with `head`."""
    line = next(line for line in text.splitlines() if line.startswith(head))
    return line[len(head) :]


def test_readme_layout_is_the_tree() -> None:
    readme = (ROOT / "README.md").read_text()
    assert _named(_row(readme, "| `services/pipeserve/` |")) == _folders(PACKAGE)
    assert _named(_row(readme, "| `tests/` |")) == _folders(ROOT / "tests")


def test_architecture_layout_is_the_tree() -> None:
    text = (ROOT / "docs/architecture.md").read_text()
    packages = text[text.index("The packages follow the processes") : text.index("Tests mirror them")]
    tests = text[text.index("Tests mirror them") : text.index("The layering is checked")]
    assert _named(packages) == _folders(PACKAGE)
    assert _named(tests) == _folders(ROOT / "tests")
