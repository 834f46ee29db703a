"""The demo checkpoint's specification, without torch.

`DemoSpec` and `SUPPORTED_ARCHES` live here, apart from the writer (pipeserve.model.demo, which needs
torch and safetensors), so that the CLI's parser — which takes its `demo-model` defaults and choices
from them — builds in images without torch (the router's, the operator's). pipeserve.model.demo
re-exports both names; import them from either.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeserve.model.arch import SUPPORTED_MODEL_TYPES

# Every registered architecture (model/arch/__init__.py's registry, which imports no torch).
SUPPORTED_ARCHES = SUPPORTED_MODEL_TYPES


@dataclass(frozen=True)
class DemoSpec:
    arch: str = "llama"
    layers: int = 4
    hidden: int = 256
    intermediate: int = 688
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 1024
    max_position_embeddings: int = 2048
    tie_embeddings: bool = False
    seed: int = 0
    bos: bool = False  # the tokenizer adds a BOS; the chat template is in chat_template.jinja

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHES:
            raise ValueError(f"arch must be one of {SUPPORTED_ARCHES}, got {self.arch!r}")
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if (self.hidden // self.heads) % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.vocab < 300:
            raise ValueError("vocab must be >= 300 (256 byte symbols + specials + merges)")
