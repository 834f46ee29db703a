"""A GGUF file's metadata as an architecture module reads it (no torch, no gguf import).

`GgufMeta(fields, tensor_names)`: the file's key-value fields (gguf.py's `metadata`) and the names of
its tensors. Keys under the architecture's prefix (`llama.block_count`) are read without it:
`meta.need("block_count")`, `meta.get("attention.sliding_window")`. A key the converter needs and the
file lacks is a ModelLoadError naming it. `tensor(name)` reads a small tensor a spec turns into config
(llama's `rope_freqs`), as float32 in HF shape. Floats stored as float32 come back as the decimal the model
was saved with (`f32`), so a converted config holds `1e-06`, not `9.99999997e-07`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeserve.errors import ModelLoadError


def f32(value: float) -> float:
    """A float32 field as its shortest decimal: 9.99999974e-06 -> 1e-05, the value the model was saved
    with (the same float32, so float32 computation does not change)."""
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class GgufMeta:
    fields: Mapping[str, Any]
    tensor_names: frozenset[str] = field(default_factory=frozenset)
    read: Callable[[str], np.ndarray] | None = None

    @classmethod
    def of(
        cls,
        fields: Mapping[str, Any],
        tensor_names: Iterable[str] = (),
        read: Callable[[str], np.ndarray] | None = None,
    ) -> GgufMeta:
        return cls(fields, frozenset(tensor_names), read)

    def tensor(self, name: str) -> np.ndarray:
        if self.read is None or name not in self.tensor_names:
            raise ModelLoadError(f"GGUF file lacks tensor {name}")
        return self.read(name)

    @property
    def arch(self) -> str:
        return str(self.fields.get("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.key`, or default."""
        return self.fields.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        if f"{self.arch}.{key}" not in self.fields:
            raise ModelLoadError(f"GGUF metadata lacks {self.arch}.{key}")
        return self.fields[f"{self.arch}.{key}"]

    def f32(self, key: str, default: float | None = None) -> float:
        value = self.need(key) if default is None else self.get(key, default)
        return f32(value)

    def blocks_with(self, key: str) -> list[int]:
        """The block indices holding tensor `blk.N.{key}`, ascending."""
        out = []
        for name in self.tensor_names:
            head, _, rest = name.partition(".")
            num, _, tail = rest.partition(".")
            if head == "blk" and tail == key and num.isdigit():
                out.append(int(num))
        return sorted(out)
