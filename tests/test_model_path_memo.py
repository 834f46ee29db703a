"""`pipeserve up`'s config check in a child is remembered once it passed: a restart does not pay
the child's torch import again, and anything the verdict depends on names a new check."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from pipeserve.config import EngineConfig
from pipeserve.errors import ModelLoadError
from pipeserve.model_path import check_config_in_child


def test_a_passed_check_is_remembered_and_only_for_its_inputs(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    home = tmp_path / "home"
    engine = EngineConfig(model=str(model), stages=1)
    check_config_in_child(engine, home)  # runs the child: passes
    assert len(list((home / "checks").iterdir())) == 1

    # The same inputs again: no child is started (an interpreter that cannot start proves it).
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    check_config_in_child(engine, home)
    # Other flags or another config.json are another check: the child must run (and cannot here).
    with pytest.raises(FileNotFoundError):
        check_config_in_child(EngineConfig(model=str(model), stages=2), home)
    monkeypatch.undo()

    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="gpt2"):  # a failure is checked each time, never kept
        check_config_in_child(engine, home)
    assert len(list((home / "checks").iterdir())) == 1
