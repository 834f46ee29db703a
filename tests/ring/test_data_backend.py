"""Which backend carries a group's activations: NCCL only when every stage has a GPU of its own."""

from __future__ import annotations

import pytest

from pipeserve.ring.group import data_backend


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
