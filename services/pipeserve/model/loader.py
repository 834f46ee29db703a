"""Load one stage's slice of an HF safetensors checkpoint.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`)
checkpoints; a stage opens only the shards that hold its tensors and reads only
those tensors, by the names the architecture's module gives (model/arch/): q/k/v
and gate/up are concatenated into the fused projections of `layers.py`, or taken
from a checkpoint that fuses them already (phi3). Every parameter of the stage
must be filled, or loading fails naming the missing tensor.
"""

from __future__ import annotations

import json
import logging
import struct
from collections import defaultdict
from collections.abc import Callable, Container
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch import get_arch
from pipeserve.model.arch.base import (
    EMBED,
    HEAD,
    LAYER_PREFIX,
    NORM,
    Either,
    Fused,
    Stack,
    checkpoint_names,
    part_sizes,
)
from pipeserve.model.arch.base import balanced_layer_split as balanced_layer_split  # the default split
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf_blocks import GgufBlocks
from pipeserve.model.gguf_blocks import install as install_blocks
from pipeserve.model.memory import return_freed_memory
from pipeserve.model.quant_q8 import quantize_model
from pipeserve.model.stage_model import StageModel, StageSpec
from pipeserve.obs.progress import Progress

log = logging.getLogger(__name__)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: model_dir / fname for name, fname in weight_map.items()}
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ModelLoadError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
    )


FINGERPRINT_SAMPLES = 64  # slices of each weight file's data read into the fingerprint
FINGERPRINT_SAMPLE_BYTES = 4096


def model_fingerprint(
    model_dir: str | Path, dtype: torch.dtype, quantization: str = "none", group_size: int = 32
) -> str:
    """xxh3 of config.json, every weight file's safetensors header and size, samples of its data,
    and the dtype.

    Headers name every tensor with its dtype, shape and byte offsets, so two
    checkpoints with the same fingerprint have the same layout; the data
    samples (FINGERPRINT_SAMPLES evenly spaced slices per file) tell apart two
    checkpoints of one architecture — a fine-tune, another seed — whose
    HiCache pages must never mix. It reads ~256 KiB per file whatever its size.
    """
    path = Path(model_dir)
    h = xxhash.xxh3_64()
    h.update((path / "config.json").read_bytes())
    for fpath in sorted(set(_weight_files(path).values())):
        size = fpath.stat().st_size
        with open(fpath, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(n))
            data_start = 8 + n
            span = max(0, size - data_start - FINGERPRINT_SAMPLE_BYTES)
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(data_start + span * i // max(1, FINGERPRINT_SAMPLES - 1))
                h.update(f.read(FINGERPRINT_SAMPLE_BYTES))
        h.update(str(size).encode())
    h.update(str(dtype).encode())
    if quantization != "none":  # a quantized model's KV pages differ from the float model's
        h.update(f"|q={quantization}|g={group_size}".encode())
    return h.hexdigest()


def _under(prefix: str, names: Container[str]) -> Callable[[str], bool]:
    """Whether a layer's tensor (a name under `prefix`) is among `names` (Either.choose's test)."""
    return lambda n: prefix + n in names


def stage_tensor_names(cfg: ModelConfig, stage: StageSpec, present: Container[str]) -> list[str]:
    """The checkpoint tensors `stage` reads: its layers' (the arch's weight names; of a parameter
    stored in more than one layout, the one the checkpoint's tensor names `present` hold), the
    embedding on the first stage, the final norm and head on the last."""
    names = [EMBED] if stage.is_first else []
    arch = get_arch(cfg.model_type)
    for i in range(stage.layer_lo, stage.layer_hi):
        prefix = LAYER_PREFIX.format(i)
        for source in arch.weights(cfg, i).values():
            if isinstance(source, Either):
                source = source.choose(_under(prefix, present))
            names += [prefix + n for n in checkpoint_names(source)]
    if stage.is_last:
        names += [NORM, EMBED if cfg.tie_word_embeddings else HEAD]
    return list(dict.fromkeys(names))


# safetensors dtype names -> torch dtypes (the format's spec; little-endian data).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def _header(fpath: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its data starts."""
    with open(fpath, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_tensor(f, meta: dict, data_start: int, name: str) -> torch.Tensor:
    """One tensor read from an open safetensors file straight into fresh memory. Plain reads, not
    safe_open's mmap: a mapping keeps every page read resident until it closes, so a stage's load
    peaked at its weights twice (file pages + copies; float32 169M: 1.52 GB for 0.88 GB held)."""
    dtype = _ST_DTYPES.get(meta["dtype"])
    if dtype is None:
        raise ModelLoadError(f"{name}: safetensors dtype {meta['dtype']} is not supported")
    lo, hi = meta["data_offsets"]
    out = torch.empty(meta["shape"], dtype=dtype)
    if out.numel() * out.element_size() != hi - lo:
        raise ModelLoadError(f"{name}: {hi - lo} bytes stored for shape {meta['shape']} {meta['dtype']}")
    if hi > lo:
        f.seek(data_start + lo)
        view = out.view(-1).view(torch.uint8).numpy()  # the tensor's bytes, writable in place
        if f.readinto(view.data) != hi - lo:
            raise ModelLoadError(f"{name}: the file ends inside its data")
    return out


def read_stage_tensors(
    model_dir: str | Path, cfg: ModelConfig, stage: StageSpec, skip: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Read exactly the checkpoint tensors `stage` needs, in cfg.dtype, but those in `skip` (served
    from elsewhere: GGUF blocks); progress in bytes read is shown as a bar on a terminal, else
    logged every few seconds (obs/progress.py)."""
    path = Path(model_dir)
    files = _weight_files(path)
    wanted = [n for n in stage_tensor_names(cfg, stage, files) if n not in skip]
    missing = [n for n in wanted if n not in files]
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks tensors: {', '.join(missing[:5])}")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in wanted:
        by_file[files[name]].append(name)
    for fpath in by_file:
        if not fpath.is_file():
            raise ModelLoadError(f"weight shard {fpath} is missing (named in the index)")
    headers = {fpath: _header(fpath) for fpath in by_file}
    total = sum(_bytes(headers[fpath][0][name]) for fpath, names in by_file.items() for name in names)
    out: dict[str, torch.Tensor] = {}
    with Progress(f"stage {stage.rank}: loading weights", total, log) as progress:
        for fpath, names in by_file.items():
            header, start = headers[fpath]
            with open(fpath, "rb") as f:
                for name in names:
                    out[name] = _read_tensor(f, header[name], start, name).to(cfg.dtype)
                    progress.update(_bytes(header[name]))
    return out


def _bytes(meta: dict) -> int:
    return meta["data_offsets"][1] - meta["data_offsets"][0]


def _fuse(t: dict[str, torch.Tensor], cfg: ModelConfig, stage: StageSpec) -> dict[str, torch.Tensor]:
    """Checkpoint names -> StageModel parameter names; consumes `t` (the fused sources are popped).
    A parameter whose sources are not in `t` (served from GGUF blocks) is left out; the loader's
    unfilled check catches any other gap."""
    params: dict[str, torch.Tensor] = {}

    def put(dst: str, *src: str) -> None:
        if not all(s in t for s in src):
            return
        if len(src) == 1:
            params[dst] = t[src[0]]  # the same tensor (a tied head shares it): kept in `t`
            return
        # Fused: the sources leave `t` as their concatenation is made, so the load's peak is the
        # checkpoint plus one fused projection, not plus every fused copy (~+60 % of the weights).
        params[dst] = torch.cat([t.pop(s) for s in src])

    if stage.is_first:
        put("embed_tokens.weight", EMBED)
    arch, sizes = get_arch(cfg.model_type), part_sizes(cfg)
    for local, i in enumerate(range(stage.layer_lo, stage.layer_hi)):
        src, dst = LAYER_PREFIX.format(i), f"layers.{local}."
        for param, source in arch.weights(cfg, i).items():
            if isinstance(source, Either):  # the layout the stage read (stage_tensor_names chose it)
                source = source.choose(_under(src, t))
            if isinstance(source, Stack):  # per-expert tensors -> [E, ...], each expert's parts in order
                names = [src + n for n in source.names()]
                if all(n in t for n in names):
                    k = len(source.parts)  # names: expert 0's parts, then expert 1's, ...
                    per_expert = (names[j : j + k] for j in range(0, len(names), k))
                    params[dst + param] = torch.stack([torch.cat([t.pop(n) for n in e]) for e in per_expert])
            elif isinstance(source, Fused):  # one checkpoint tensor, its parts put in the layer's order
                if src + source.name in t:
                    params[dst + param] = source.reorder(t.pop(src + source.name), sizes)
            else:
                put(dst + param, *(src + n for n in source.names))
    if stage.is_last:
        put("norm.weight", NORM)
        put("lm_head.weight", EMBED if cfg.tie_word_embeddings else HEAD)
    return params


def load_stage_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    stage: StageSpec,
    max_len: int,
    device: torch.device,
    quantization: str = "none",
    group_size: int = 32,
) -> StageModel:
    with torch.device("meta"):
        model = StageModel(cfg, stage, max_len).to(cfg.dtype)
    served: set[str] = set()
    if quantization == "gguf":  # the file's blocks, installed before any float tensor is read
        with GgufBlocks(model_dir) as blocks:
            served = install_blocks(model, blocks, cfg, stage, device)
    params = _fuse(read_stage_tensors(model_dir, cfg, stage, frozenset(served)), cfg, stage)
    own = dict(model.named_parameters())
    unfilled = sorted(set(own) - set(params))
    if unfilled:
        raise ModelLoadError(f"no checkpoint tensor for parameters: {', '.join(unfilled[:5])}")
    for name, value in params.items():
        if tuple(own[name].shape) != tuple(value.shape):
            raise ModelLoadError(
                f"shape mismatch for {name}: checkpoint {tuple(value.shape)}, "
                f"config expects {tuple(own[name].shape)}"
            )
    model.load_state_dict(params, strict=False, assign=True)
    model.requires_grad_(False)
    model = model.to(device).eval()
    quantize_model(model, quantization, group_size)
    model.pack_weights()
    if model.use_native_decode():  # last: it holds pointers to the weights as they now are
        log.info(
            "stage %d: decode steps of up to %d rows run natively (pipeserve_kernels.native)",
            stage.rank,
            model.native.max_rows if model.native is not None else 0,
        )
    return_freed_memory()  # the load's temporaries (~200 MB for the default model in gguf mode)
    return model
