"""The committed gRPC modules are what the .proto generates (run `make proto` after editing it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


def test_generated_modules_are_current(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(ROOT / "services"),
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / "services/pipeserve/rpc/generation.proto"),
        ],
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "pipeserve/rpc" / name).read_text()
        committed = (ROOT / "services/pipeserve/rpc" / name).read_text()
        assert committed == fresh, f"services/pipeserve/rpc/{name} is stale: run `make proto`"
