"""pipeserve: pipeline-parallel LLM serving.

Offline API: `from pipeserve import LLM, SamplingParams`.
"""

from pipeserve.entrypoints.llm import LLM
from pipeserve.outputs import CompletionOutput, RequestOutput
from pipeserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
