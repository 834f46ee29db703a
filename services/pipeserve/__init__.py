"""pipeserve: pipeline-parallel LLM serving.

Offline API: `from pipeserve import LLM, SamplingParams`.

Contract: importing the package imports neither torch nor safetensors nor transformers. `LLM` (the offline
engine, which runs a model) is resolved on first access (PEP 562 module `__getattr__`), so the processes
that never run a model — `pipeserve router`, `pipeserve-operator` — import `pipeserve.*` in images without
torch (tests/k8s/test_images.py runs them under a Python whose torch import fails). The results and the
sampling parameters are plain dataclasses and stay eager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeserve.outputs import CompletionOutput, RequestOutput
from pipeserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # mypy sees the name; at run time it is imported on first use below
    from pipeserve.entrypoints.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pipeserve.entrypoints.llm import LLM

        globals()["LLM"] = LLM  # later lookups find it without coming here
        return LLM
    raise AttributeError(f"module 'pipeserve' has no attribute {name!r}")
