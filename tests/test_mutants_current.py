"""Every mutant in tests/mutations/*.toml still applies: its snippet is in its file (the runner
replaces the first), and each entry is well formed.

A mutant whose snippet has moved away (the code was rewritten) cannot break its rule any more, so
its RED proves nothing; this check names it the moment the code changes, not at the next mutant run.
"""

from __future__ import annotations

import runpy
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"name", "file", "find", "replace", "tests"}


def test_every_mutant_snippet_is_in_its_file_once() -> None:
    mutants = runpy.run_path(str(ROOT / "tests" / "mutants.py"), run_name="mutants")["MUTANTS"]
    assert len(mutants) > 300, "the mutants were not all read"
    stale = []
    for name, path, old, new, _tests in mutants:
        text = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        if text.count(old) < 1 or old == new:
            stale.append(f"{name}: {path}: {old.strip()[:80]!r}")
    assert not stale, "mutants that no longer apply:\n" + "\n".join(stale)


def test_every_mutant_entry_is_well_formed() -> None:
    """Each entry has exactly the five keys, all strings (only `replace` may be empty: a deletion);
    names are unique (they select a run)."""
    names: list[str] = []
    for path in sorted((ROOT / "tests" / "mutations").glob("*.toml")):
        for i, m in enumerate(tomllib.loads(path.read_text())["mutant"]):
            where = f"{path.name} entry {i}"
            assert set(m) == KEYS, f"{where}: keys {sorted(m)}"
            assert all(isinstance(v, str) for v in m.values()), where
            assert all(m[k] for k in KEYS - {"replace"}), f"{where}: an empty field"
            names.append(m["name"])
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"mutant names used twice: {dupes}"
