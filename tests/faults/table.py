"""The fault table of benchmarks/RESULTS.md (issue 29) from a run of the multi-host fault suite.

    .venv/bin/python tests/faults/table.py            # runs the suite (pytest -m faults), prints it
    .venv/bin/python tests/faults/table.py DIR        # prints the rows a run with --basetemp DIR left

Each test records its fault's row (checker.Table) in <basetemp>/faults-table.jsonl: the requests
ok / failed clean / hung (or wrong), their p99 latency, and the seconds from the heal until every
stage and the router were ready again ("-": the group never left Ready).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def table(rows: list[dict]) -> str:
    out = [
        "| fault | ok | failed clean | hung / wrong | p99 latency | time to Ready after the heal |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ready = "-" if r["ready_s"] is None else f"{r['ready_s']:.1f} s"
        bad, p99 = f"{r['hung']} / {r['wrong']}", f"{r['p99_s']:.2f} s"
        out.append(f"| {r['fault']} | {r['ok']} | {r['failed_clean']} | {bad} | {p99} | {ready} |")
    return "\n".join(out)


def main() -> int:
    if len(sys.argv) > 1:
        base, code = Path(sys.argv[1]), 0
    else:
        base = Path(tempfile.mkdtemp(prefix="pipeserve-faults-"))
        argv = [sys.executable, "-m", "pytest", "-q", "-m", "faults", "tests/faults", "--basetemp", str(base)]
        code = subprocess.run(argv, cwd=ROOT).returncode
    path = base / "faults-table.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    print(table(rows))
    return code


if __name__ == "__main__":
    sys.exit(main())
