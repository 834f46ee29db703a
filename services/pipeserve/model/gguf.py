"""Convert a GGUF checkpoint (llama.cpp's format) into an HF-layout safetensors checkpoint.

`convert_gguf(SRC.gguf, DST_DIR)` writes what the rest of pipeserve loads
(`config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`), so GGUF files take the same
loader path as every other checkpoint: convert once, then serve the directory.

Contract:
* Architectures: `llama` (which also covers Mistral-style GGUFs). Anything else
  is a ModelLoadError naming the architecture.
* Every tensor is dequantized to float32 with the `gguf` package (the file's
  F32 tensors are copied as they are), so the checkpoint is float32 whatever
  the file's quantization; a type `gguf` cannot dequantize is a ModelLoadError
  naming the tensor and the type.
* The tensors in block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are also kept as
  blocks in `quantized.safetensors` (model/gguf_blocks.py, in the form model/gguf_types.py gives
  each type), which `--quantization gguf` serves without dequantizing. A tensor of any other type
  than those and F32/F16/BF16 (Q2_K, Q3_K, the IQ types) is a ModelLoadError naming the types
  served, before anything is written.
* llama.cpp's converter permutes the rows of q_proj / k_proj (per head, the
  two rotary halves interleaved for its rope layout); they are permuted back,
  so the result is the HF layout the engine and transformers expect.
* Every GGUF tensor maps to an HF name, or conversion fails naming it (nothing
  is silently dropped). No `output.weight` means tied embeddings.
* The file's sampling metadata (llama.cpp's `general.sampling.*`, what its converter writes from
  generation_config.json) goes back into generation_config.json under HF's names, where the router
  takes request defaults from (request_defaults.py). llama.cpp applies penalty_repeat over the last
  penalty_last_n tokens; HF's repetition_penalty, which it becomes, over the whole sequence.
* `progress_s`: the dequantization's progress (bytes of the file's tensors) as a bar on a terminal,
  else a log line every progress_s seconds (obs/progress.py).
* DST is written atomically: into a temporary sibling directory that is
  renamed onto DST at the end, so a crash never leaves a half checkpoint.
  An existing non-empty DST is refused.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch import gguf_architectures
from pipeserve.obs.progress import Progress

# llama.cpp architecture -> its Arch (model/arch/: an Arch's `gguf` spec names its file's tensors).
_GGUF_ARCHES = gguf_architectures()
SUPPORTED_ARCHITECTURES = tuple(_GGUF_ARCHES)

# GGUF name (per block: `blk.N.` + key) -> HF name (per layer: `model.layers.N.` + value).
_BLOCK_NAMES = _GGUF_ARCHES["llama"].gguf.block_names
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# llama.cpp's sampling metadata (gguf-py's Keys.General.SAMPLING_*) -> generation_config.json's key
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
log = logging.getLogger("pipeserve.model")


def open_gguf(path: str | Path):  # -> gguf.GGUFReader (imported lazily: only conversion needs it)
    import gguf

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"GGUF file {p} does not exist")
    try:
        return gguf.GGUFReader(p)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{p} is not a readable GGUF file: {e}") from None


def metadata(reader) -> dict:
    """Every key-value field of the file as a Python value (arrays as lists)."""
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = field.contents()
    return out


def _f32(value: float) -> float:
    """A float32 field as its shortest decimal: 9.99999974e-06 -> 1e-05, the value the model was saved
    with (the same float32, so float32 computation does not change)."""
    return float(str(np.float32(value)))


def hf_config(meta: dict, has_output: bool) -> tuple[dict, dict]:
    """(config.json, generation_config.json) from the file's metadata."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", 0)))
    head_dim = head_dim or hidden // heads
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise ModelLoadError("GGUF metadata gives neither the vocabulary size nor the tokens")
    rope: dict = {"rope_type": "default", "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_f32(meta[f"{arch}.rope.scaling.factor"]))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "float32",
    }
    gen = {
        k: v
        for k, v in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad))
        if v is not None
    }
    for key, name in SAMPLING_KEYS.items():
        if meta.get(key) is not None:
            gen[name] = int(meta[key]) if name == "top_k" else _f32(meta[key])
    return config, gen


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no HF counterpart in a llama checkpoint")


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, rows (half, pair) -> (pair, half).

    llama.cpp writes row `h*d + 2*i + j` from HF row `h*d + j*(d/2) + i`
    (d = head_dim, i < d/2, j in {0, 1}); reading it back swaps those two axes again.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def dequantized(tensor) -> np.ndarray:
    """One GGUF tensor as float32 in HF shape (GGUF lists dimensions innermost first)."""
    from gguf import GGMLQuantizationType, quants

    try:
        data = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name}: quantization {GGMLQuantizationType(tensor.tensor_type).name} "
            "cannot be dequantized"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # F32 tensors come back as read-only views of the file's mmap: copy those.
    return np.array(data, dtype=np.float32, copy=not data.flags.writeable or None).reshape(shape)


def hf_tensors(reader, config: dict, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its HF name, float32, q/k in HF row order."""
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = torch.from_numpy(dequantized(t))
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rows(w, config["num_key_value_heads"])
        out[name] = w
        if progress is not None:
            progress.update(int(t.n_bytes))
    return out


def hf_blocks(reader, config: dict) -> dict[str, torch.Tensor]:
    """The blocks of every tensor in a block type under `HF name.suffix` (gguf_blocks' layout),
    q/k rows in HF order like `hf_tensors`."""
    from pipeserve.model.gguf_blocks import permute_blocks
    from pipeserve.model.gguf_types import read_blocks

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        blocks = read_blocks(t)
        if blocks is None:
            continue
        name = hf_name(t.name)
        heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
        for proj, n in heads.items():
            if name.endswith(f"self_attn.{proj}_proj.weight"):
                blocks = permute_blocks(blocks, partial(unpermute_rows, n_heads=n))
        out.update({f"{name}.{k}": v for k, v in blocks.items()})
    return out


def convert_gguf(src: str | Path, dst: str | Path, progress_s: float | None = None) -> Path:
    """Write the HF checkpoint of the GGUF file `src` into the new directory `dst` (atomically)."""
    from pipeserve.model.gguf_blocks import BLOCK, BLOCKS_FILE, FORMAT
    from pipeserve.model.gguf_tokenizer import write_tokenizer_files
    from pipeserve.model.gguf_types import check_types, form, type_name

    out = Path(dst)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelLoadError(f"{out} already exists and is not an empty directory")
    reader = open_gguf(src)
    meta = metadata(reader)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config, gen = hf_config(meta, has_output)
    check_types(reader.tensors)
    types = {hf_name(t.name): type_name(t) for t in reader.tensors}
    if progress_s is None:
        tensors = hf_tensors(reader, config)
    else:
        total = sum(int(t.n_bytes) for t in reader.tensors)
        with Progress(f"converting {Path(src).name}", total, log, interval_s=progress_s) as progress:
            tensors = hf_tensors(reader, config, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed conversion with this pid
    tmp.mkdir()
    try:
        write_tokenizer_files(tmp, meta, config["max_position_embeddings"])
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        blocks = hf_blocks(reader, config)
        written = ["model.safetensors"]
        if set(types.values()) != {"F32"}:  # each tensor's type and served form, dense ones too
            forms = {name: form(t) for name, t in types.items()}
            info = {
                "format": FORMAT,
                "block": str(BLOCK),
                "types": json.dumps(types),
                "forms": json.dumps(forms),
            }
            save_file(blocks, str(tmp / BLOCKS_FILE), metadata=info)
            written.append(BLOCKS_FILE)
        # safetensors creates its file owner-only; give it the mode (umask) the other files got.
        for fname in written:
            os.chmod(tmp / fname, (tmp / "config.json").stat().st_mode)
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename needs the name free
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
