"""tests/e2e/kind.sh cannot run here (no container runtime); its dry mode can: the script's syntax
(bash -n, shellcheck where installed) and every manifest the real run would install, rendered with
its values and validated (Kubernetes 1.35 schemas, the example pipeline against its CRD)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from chart_support import k8s_tools

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "kind.sh"


def _dry_run(script: Path) -> subprocess.CompletedProcess:
    tools = k8s_tools()  # make k8s-tools' helm and kubectl
    env = {**os.environ, "PYTHON": sys.executable, "HELM": str(tools.helm), "KUBECTL": str(tools.kubectl)}
    env["E2E_ROOT"] = str(ROOT)  # a copied script renders this checkout's chart
    return subprocess.run(
        ["bash", str(script), "--dry-run"], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_dry_run_checks_the_script_and_what_it_would_apply() -> None:
    done = _dry_run(SCRIPT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "objects valid: " in done.stdout and "InferencePipeline" in done.stdout
    assert done.stdout.rstrip().endswith("dry run: ok")


def test_the_dry_run_fails_on_a_manifest_it_would_break(tmp_path: Path) -> None:
    """A value the chart's values schema passes through (affinity is free-form there) but that renders
    a Deployment the API server would refuse: the dry run says so."""
    broken = tmp_path / "kind.sh"
    value = '"example.stages=2" --set "router.affinity.bogus=1"'
    broken.write_text(SCRIPT.read_text().replace('"example.stages=2"', value))
    done = _dry_run(broken)
    refused = "Additional properties are not allowed ('bogus' was unexpected)"
    assert done.returncode != 0 and refused in done.stderr, done.stdout + done.stderr
