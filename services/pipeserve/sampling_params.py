"""SamplingParams: what a caller asks of one generation (vLLM's shape).

Validation raises InvalidRequestError naming the field, at construction, so a
bad request never reaches the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeserve.errors import InvalidRequestError

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a
# temperature whose reciprocal leaves float32 would make inf/NaN probabilities.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob + top k

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def fail(param: str, msg: str) -> None:
            raise InvalidRequestError(param, msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            fail("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            fail("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            fail("temperature", f"must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            fail("temperature", f"must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", f"must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, int | float) or not 0 <= self.min_p <= 1:
            fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            fail("seed", f"must be a non-negative integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            fail("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1
