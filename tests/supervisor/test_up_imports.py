"""`pipeserve up` never runs a model, so it must not import torch (~1.7 s and ~0.2 GB of its start-up
and RSS): every module its run path imports is imported here in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

UP_PATH = (
    "pipeserve.cli",
    "pipeserve.supervisor.up",
    "pipeserve.local.launcher",
    "pipeserve.local.redis_server",
    "pipeserve.model.default",
    "pipeserve.model.gguf_cache",
    "pipeserve.model_path",
    "pipeserve.request_defaults",
    "pipeserve.router.http.app",
    "pipeserve.router.upstream.replicas",
    "pipeserve.supervisor.group",
    "pipeserve.supervisor.supervisor",
    "pipeserve.obs.tracing",
)


def test_up_imports_no_torch():
    code = f"import sys\nfor m in {UP_PATH!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "a module on `pipeserve up`'s path imports torch"
