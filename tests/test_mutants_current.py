"""Every mutant in tests/mutants.py still applies: its snippet is in its file (the runner replaces the first).

A mutant whose snippet has moved away (the code was rewritten) cannot break its rule any more, so
its RED proves nothing; this check names it the moment the code changes, not at the next mutant run.
"""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_mutant_snippet_is_in_its_file_once() -> None:
    mutants = runpy.run_path(str(ROOT / "tests" / "mutants.py"), run_name="mutants")["MUTANTS"]
    stale = []
    for name, path, old, new, _tests in mutants:
        text = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        if text.count(old) < 1 or old == new:
            stale.append(f"{name}: {path}: {old.strip()[:80]!r}")
    assert not stale, "mutants that no longer apply:\n" + "\n".join(stale)
