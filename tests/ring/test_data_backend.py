"""Which backend carries a group's activations (NCCL only when every stage has a GPU of its own), and
the stage's device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.errors import ConfigError
from pipeserve.ring.group import data_backend
from pipeserve.stage.assemble import stage_device


@pytest.mark.parametrize(
    "gpus, backend",
    [
        (["GPU-a", "GPU-b", "GPU-c"], "nccl"),  # a Kubernetes group: one GPU per stage pod
        (["GPU-a"], "nccl"),
        (["", ""], "gloo"),  # CPU stages
        (["GPU-a", ""], "gloo"),  # a CPU stage in the group: NCCL cannot reach it
        (["GPU-a", "GPU-a"], "gloo"),  # two stages on one GPU: NCCL cannot pair them
        (["GPU-a", "GPU-b", "GPU-a"], "gloo"),
        ([], "gloo"),
    ],
)
def test_data_backend(gpus: list[str], backend: str) -> None:
    assert data_backend(gpus) == backend


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_without_a_visible_gpu_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="device: cuda but this process sees no CUDA device"):
        stage_device(EngineConfig(model=str(tmp_path), device="cuda"), 1)
    assert stage_device(EngineConfig(model=str(tmp_path)), 1) == torch.device("cpu")
