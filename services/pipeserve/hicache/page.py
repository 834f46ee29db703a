"""An L3 page: one stage's K/V of one full block, and its Redis key.

Key: `pipeserve:<fingerprint>:<layout>:<stage>:{<block_hash>}`. The hash tag
(the braces) holds only the block hash, so every stage's page of one block
maps to the same Redis Cluster slot: stage 0 asks whether a block exists for
every stage in one round trip, on one node. The fingerprint (checkpoint,
dtype, block size, layer split) and the layout (this stage's layers and the
page shape) are in the key, so a different model or split never reads a page.

Value: a fixed little-endian header, then the raw bytes of the page tensor
[layers, 2 (K, V), block_size, kv_heads, head_dim] in the pool's dtype:

  magic "PSKV" | format u16 | dtype code u8 | 0 u8 | tokens u32 |
  shape 5 x u32 | xxh3-128 of the payload (16 bytes)

Nothing is pickled. `decode_page` checks every field against the layout the
reader expects and the checksum against the bytes; any difference is a
PageError naming what differed (the reader counts it and recomputes).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import xxhash

FORMAT = 1
MAGIC = b"PSKV"
_HEADER = struct.Struct("<4sHBxI5I16s")
HEADER_BYTES = _HEADER.size
# Codes are part of the format: append only.
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


class PageError(ValueError):
    """A stored page that must not be used; `kind` is "format", "layout" or "checksum"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class PageLayout:
    """What one stage's page of a block is: whose model, which layers, which shape."""

    fingerprint: str  # the group's model fingerprint (checkpoint, dtype) — congruent on every stage
    stage: int
    layer_lo: int
    layer_hi: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: pages hold {sorted(map(str, _DTYPES))}, not {self.dtype}")
        if not 0 <= self.layer_lo < self.layer_hi:
            raise ValueError(f"layers: need 0 <= lo < hi (got {self.layer_lo}:{self.layer_hi})")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layer_hi - self.layer_lo, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value: the header and the payload."""
        return HEADER_BYTES + self.payload_bytes

    @property
    def tag(self) -> str:
        """The layout part of the key: dtype, block size, this stage's layers, heads x dim."""
        name = str(self.dtype).removeprefix("torch.")
        return f"{name}-b{self.block_size}-l{self.layer_lo}_{self.layer_hi}-h{self.kv_heads}x{self.head_dim}"

    def key(self, block_hash: int) -> str:
        return page_key(self.fingerprint, self.tag, self.stage, block_hash)


def page_key(fingerprint: str, tag: str, stage: int, block_hash: int) -> str:
    return f"pipeserve:{fingerprint}:{tag}:{stage}:{{{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}}}"


def encode_page(layout: PageLayout, page: torch.Tensor, tokens: int) -> bytes:
    """The stored value of `page` ([layers, 2, block_size, kv_heads, head_dim], any device)."""
    if tuple(page.shape) != layout.shape or page.dtype != layout.dtype:
        raise ValueError(f"page {tuple(page.shape)} {page.dtype} is not {layout.shape} {layout.dtype}")
    if not 0 < tokens <= layout.block_size:
        raise ValueError(f"tokens: a page holds 1..{layout.block_size} tokens (got {tokens})")
    # Raw bytes of a contiguous host copy; a bfloat16 page goes through an int16 view (numpy has none).
    host = page.detach().to("cpu").contiguous()
    payload = (
        host.view(torch.int16).numpy().tobytes() if host.dtype == torch.bfloat16 else host.numpy().tobytes()
    )
    return page_header(layout, payload, tokens) + payload


def page_header(layout: PageLayout, payload: bytes | memoryview, tokens: int) -> bytes:
    """The header of a value whose payload is `payload` (the raw bytes of a page of `layout`):
    the writer packs it in front of a page it staged, so the value needs no copy of its own."""
    digest = xxhash.xxh3_128_digest(payload)
    return _HEADER.pack(MAGIC, FORMAT, _DTYPES[layout.dtype], tokens, *layout.shape, digest)


def decode_page(layout: PageLayout, value: bytes) -> tuple[torch.Tensor, int]:
    """(page tensor on the CPU, tokens) from a stored value, or PageError."""
    if len(value) < HEADER_BYTES:
        raise PageError("format", f"{len(value)} bytes: shorter than the header")
    magic, fmt, code, tokens, *rest = _HEADER.unpack_from(value)
    shape, digest = tuple(rest[:5]), rest[5]
    if magic != MAGIC or fmt != FORMAT:
        raise PageError("format", f"magic {magic!r} format {fmt} (expected {MAGIC!r} {FORMAT})")
    if _CODES.get(code) != layout.dtype or shape != layout.shape:
        raise PageError("layout", f"{_CODES.get(code)} {shape} (expected {layout.dtype} {layout.shape})")
    if not 0 < tokens <= layout.block_size:
        raise PageError("layout", f"{tokens} tokens in a block of {layout.block_size}")
    payload = memoryview(value)[HEADER_BYTES:]
    if len(payload) != layout.payload_bytes:
        raise PageError("format", f"payload of {len(payload)} bytes (expected {layout.payload_bytes})")
    if xxhash.xxh3_128_digest(payload) != digest:
        raise PageError("checksum", "the payload's xxh3-128 differs from the header's")
    if layout.dtype == torch.bfloat16:
        flat = torch.frombuffer(bytearray(payload), dtype=torch.int16).view(torch.bfloat16)
    else:
        flat = torch.frombuffer(bytearray(payload), dtype=layout.dtype)
    return flat.view(layout.shape), tokens
