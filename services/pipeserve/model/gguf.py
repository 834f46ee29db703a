"""Convert a GGUF checkpoint (llama.cpp's format) into an HF-layout safetensors checkpoint.

`convert_gguf(SRC.gguf, DST_DIR)` writes what the rest of pipeserve loads
(`config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`), so GGUF files take the same
loader path as every other checkpoint: convert once, then serve the directory.

Contract:
* Architectures: those whose arch module (model/arch/) declares a `GgufSpec`: llama.cpp's
  architecture name, its per-block tensor names, its config.json fields from the metadata, whether
  q/k rows are permuted and what was added to the norm weights. Mistral files are llama.cpp's
  `llama` and convert to llama (the same layer; llama.cpp keeps no window for them). Any other
  `general.architecture` is a ModelLoadError naming the supported ones, raised before anything is
  read or written (and before any process starts: model_path converts before `up` starts stages).
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
  two rotary halves interleaved for its rope layout) of the archs whose spec says
  `permuted_qk` (llama, mixtral; not the NEOX-rope ones); they are permuted back,
  so the result is the HF layout the engine and transformers expect. Gemma's norm
  weights were stored as 1 + w (`norm_shift`); w is given back (exactly: the
  subtraction of 1 from a float32 in [0.5, 2] is exact, and the layer adds it again).
* Expert tensors (`ffn_gate_exps`, ... [E, rows, cols]) become one HF tensor per expert
  (transformers 4's per-expert names, which the MoE layers' loader stacks).
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
from typing import TypeVar

import numpy as np
import torch
from safetensors.torch import save_file

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch import SUPPORTED_MODEL_TYPES, get_arch
from pipeserve.model.gguf_meta import GgufMeta, f32
from pipeserve.obs.progress import Progress

# The archs whose GGUF files convert (model/arch/: an Arch's `gguf` spec), in registry order.
_GGUF_ARCHES = [a for a in map(get_arch, SUPPORTED_MODEL_TYPES) if a.gguf is not None]
SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys(a.gguf.name for a in _GGUF_ARCHES))

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


def file_arch(meta: GgufMeta):  # -> arch/base.Arch
    """The Arch a file converts to: its `general.architecture`, and the first spec of that name that
    claims it (llama and mixtral share "llama"); a ModelLoadError naming the supported ones else."""
    for arch in _GGUF_ARCHES:
        if arch.gguf.name == meta.arch and arch.gguf.claims(meta):
            return arch
    raise ModelLoadError(
        f"unsupported GGUF architecture {meta.arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def hf_config(meta: GgufMeta, has_output: bool) -> tuple[dict, dict]:
    """(config.json, generation_config.json) from the file's metadata: the keys every llama.cpp arch
    writes (TextModel.set_gguf_parameters) here, the arch's own through its spec (`config`)."""
    arch = file_arch(meta)
    scaling = meta.get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear")
    heads = int(meta.need("attention.head_count"))
    hidden = int(meta.need("embedding_length"))
    vocab = meta.get("vocab_size") or len(meta.fields.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise ModelLoadError("GGUF metadata gives neither the vocabulary size nor the tokens")
    rope: dict = {"rope_type": "default", "rope_theta": meta.f32("rope.freq_base", 10000.0)}
    if scaling == "linear":
        rope.update(rope_type="linear", factor=meta.f32("rope.scaling.factor"))
    bos = meta.fields.get("tokenizer.ggml.bos_token_id")
    eos = meta.fields.get("tokenizer.ggml.eos_token_id")
    pad = meta.fields.get("tokenizer.ggml.padding_token_id")
    config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta.need("feed_forward_length")),
        "num_hidden_layers": int(meta.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("attention.head_count_kv", heads)),
        "head_dim": int(meta.get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta.get("context_length", 2048)),
        "rms_norm_eps": meta.f32("attention.layer_norm_rms_epsilon"),
        "rope_parameters": rope,
        "tie_word_embeddings": not has_output,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "float32",
    }
    config.update(arch.gguf.config(meta))
    if "rope_freqs.weight" in meta.tensor_names and config["rope_parameters"].get("rope_type") != "llama3":
        raise ModelLoadError(
            f"GGUF tensor rope_freqs.weight: llama3 rope factors in a {arch.model_type} file"
        )
    gen = {
        k: v
        for k, v in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad))
        if v is not None
    }
    for key, name in SAMPLING_KEYS.items():
        if meta.fields.get(key) is not None:
            gen[name] = int(meta.fields[key]) if name == "top_k" else f32(meta.fields[key])
    return config, gen


# Tensors a spec reads into config.json (llama's llama3 rope factors), not weights of the checkpoint.
CONFIG_TENSORS = ("rope_freqs.weight",)


def _weights(reader) -> list:
    return [t for t in reader.tensors if t.name not in CONFIG_TENSORS]


def hf_names(gguf_name: str, spec, rows: int) -> list[str]:
    """The HF tensor(s) GGUF tensor `gguf_name` holds under `spec` (arch/base.GgufSpec): one, or one
    per expert (`rows` of them) for a stacked expert tensor."""
    if gguf_name in _TOP_NAMES:
        return [_TOP_NAMES[gguf_name]]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in spec.block_names:
        name = f"model.layers.{m.group(1)}.{spec.block_names[m.group(2)]}"
        return [name.format(e=e) for e in range(rows)] if "{e}" in name else [name]
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no HF counterpart in a {spec.name} checkpoint")


def permuted_heads(name: str, spec, config: dict) -> int | None:
    """The head count by which llama.cpp permuted the rows of HF tensor `name` (q/k weights and
    biases of a `permuted_qk` arch), else None."""
    if spec.permuted_qk:
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return config["num_attention_heads"]
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return config["num_key_value_heads"]
    return None


def to_hf(name: str, w: torch.Tensor, spec, config: dict) -> torch.Tensor:
    """Undo what llama.cpp's converter did to HF tensor `name`: its q/k row order, its norm shift."""
    heads = permuted_heads(name, spec, config)
    if heads is not None:
        return unpermute_rows(w, heads)
    if spec.norm_shift and name.endswith("norm.weight"):
        return w - spec.norm_shift
    return w


Part = TypeVar("Part", torch.Tensor, dict[str, torch.Tensor])


def _split(gguf_name: str, w: Part, spec) -> list[tuple[str, Part]]:
    """(HF name, part) for each HF tensor in `w` (a tensor, or a dict of block arrays), split along
    dim 0 for a stacked expert tensor."""
    first = w if isinstance(w, torch.Tensor) else next(iter(w.values()))
    m = _BLOCK_RE.fullmatch(gguf_name)
    names = hf_names(gguf_name, spec, int(first.shape[0]))
    if not (m and "{e}" in spec.block_names.get(m.group(2), "")):
        return [(names[0], w)]
    if isinstance(w, torch.Tensor):
        return [(n, w[e].contiguous()) for e, n in enumerate(names)]
    return [(n, {k: v[e].contiguous() for k, v in w.items()}) for e, n in enumerate(names)]


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


def hf_tensors(reader, spec, config: dict, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its HF name, float32, as HF holds it (`to_hf`)."""
    out: dict[str, torch.Tensor] = {}
    for t in _weights(reader):
        for name, w in _split(t.name, torch.from_numpy(dequantized(t)), spec):
            out[name] = to_hf(name, w, spec, config)
        if progress is not None:
            progress.update(int(t.n_bytes))
    return out


def hf_blocks(reader, spec, config: dict) -> dict[str, torch.Tensor]:
    """The blocks of every tensor in a block type under `HF name.suffix` (gguf_blocks' layout),
    q/k rows in HF order like `hf_tensors` (blocks lie within rows: the same row permutation)."""
    from pipeserve.model.gguf_blocks import permute_blocks
    from pipeserve.model.gguf_types import read_blocks

    out: dict[str, torch.Tensor] = {}
    for t in _weights(reader):
        blocks = read_blocks(t)
        if blocks is None:
            continue
        for name, part in _split(t.name, blocks, spec):
            heads = permuted_heads(name, spec, config)
            if heads is not None:
                part = permute_blocks(part, partial(unpermute_rows, n_heads=heads))
            out.update({f"{name}.{k}": v for k, v in part.items()})
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
    fields = metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    meta = GgufMeta.of(fields, by_name, lambda name: dequantized(by_name[name]))
    has_output = "output.weight" in meta.tensor_names
    config, gen = hf_config(meta, has_output)
    spec = file_arch(meta).gguf
    check_types(reader.tensors)
    types = {
        name: type_name(t)
        for t in _weights(reader)
        for name in hf_names(t.name, spec, int(t.shape[-1]) if len(t.shape) == 3 else 1)
    }
    if progress_s is None:
        tensors = hf_tensors(reader, spec, config)
    else:
        total = sum(int(t.n_bytes) for t in _weights(reader))
        with Progress(f"converting {Path(src).name}", total, log, interval_s=progress_s) as progress:
            tensors = hf_tensors(reader, spec, config, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed conversion with this pid
    tmp.mkdir()
    try:
        write_tokenizer_files(tmp, fields, config["max_position_embeddings"])
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        blocks = hf_blocks(reader, spec, config)
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
