"""The architecture registry: config.json's `model_type` -> the module that implements it.

One module per architecture (llama.py, qwen3.py, ...), each exporting `ARCH`, an `Arch`
(arch/base.py): its config mapping, decoder layer, checkpoint weight names (HF and GGUF), stage
split and what the native decode step supports. Adding an architecture is one module, one line
below and its test (docs/models.md).

Modules are imported by name when first asked for: config.py dispatches to them while they build
on config.py's ModelConfig and layers.py's parts, so this module imports none of them (an `Arch`
is typed as Any here; its type is arch/base.py's).
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeserve.errors import ModelLoadError

# model_type -> module under pipeserve.model.arch
REGISTRY = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}
SUPPORTED_MODEL_TYPES = tuple(REGISTRY)


def get_arch(model_type: object) -> Any:
    """The Arch of `model_type`; a ModelLoadError naming the supported ones for any other."""
    if not isinstance(model_type, str) or model_type not in REGISTRY:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return importlib.import_module(f"{__name__}.{REGISTRY[model_type]}").ARCH
