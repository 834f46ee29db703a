"""Deterministic demo checkpoints in Hugging Face layout.

`write_demo_model(DIR, DemoSpec(...))` writes `config.json`, `generation_config.json`,
`model.safetensors`, `tokenizer.json` and `tokenizer_config.json` so that both
pipeserve and `transformers.AutoModelForCausalLM` / `AutoTokenizer` load it.
`DemoSpec(bos=True)` writes a Llama-3-like tokenizer instead: a `<|begin_of_text|>`
BOS added by the tokenizer's post-processor (TemplateProcessing; `add_bos_token`
in tokenizer_config.json) and written by the chat template, which lives in
`chat_template.jinja` (transformers 5's layout; no `chat_template` key). The
same spec always gives byte-identical weights (a seeded CPU generator), and the
tokenizer is a byte-level BPE trained here on `corpus.txt`, which ships with the
package: nothing is fetched.

Weights are scaled so logits are far apart (std of several units): greedy
comparisons against transformers then do not hinge on 1e-6 ties.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# The spec lives in a module without torch (the CLI parser reads it); re-exported here.
from pipeserve.model.arch import get_arch
from pipeserve.model.config import ModelConfig
from pipeserve.model.demo_arch import arch_fields, arch_weights
from pipeserve.model.demo_spec import SUPPORTED_ARCHES as SUPPORTED_ARCHES
from pipeserve.model.demo_spec import DemoSpec as DemoSpec

# Weights these two get from _weights (the checkpoints they always had); every other registered
# architecture's come from demo_arch.py.
HAND_WRITTEN = ("llama", "qwen2")

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# ChatML; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BOS_CHAT_TEMPLATE = "{{ bos_token }}" + CHAT_TEMPLATE  # as Llama-3's: the template writes the BOS


def train_tokenizer(vocab_size: int, bos: bool = False) -> Tokenizer:
    text = resources.files("pipeserve.model").joinpath("corpus.txt").read_text("utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + ([BOS_TOKEN] if bos else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    if bos:
        bos_id = tok.token_to_id(BOS_TOKEN)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
    return tok


def _weights(spec: DemoSpec, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden // spec.heads

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal((spec.hidden,), 0.1)

    h, inter = spec.hidden, spec.intermediate
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, h), 0.25)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = normal((spec.heads * head_dim, h), 1 / math.sqrt(h))
        w[p + "self_attn.k_proj.weight"] = normal((spec.kv_heads * head_dim, h), 1 / math.sqrt(h))
        w[p + "self_attn.v_proj.weight"] = normal((spec.kv_heads * head_dim, h), 1 / math.sqrt(h))
        w[p + "self_attn.o_proj.weight"] = normal((h, spec.heads * head_dim), 1 / math.sqrt(h))
        if spec.arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal((spec.heads * head_dim,), 0.1)
            w[p + "self_attn.k_proj.bias"] = normal((spec.kv_heads * head_dim,), 0.1)
            w[p + "self_attn.v_proj.bias"] = normal((spec.kv_heads * head_dim,), 0.1)
        w[p + "mlp.gate_proj.weight"] = normal((inter, h), 1 / math.sqrt(h))
        w[p + "mlp.up_proj.weight"] = normal((inter, h), 1 / math.sqrt(h))
        w[p + "mlp.down_proj.weight"] = normal((h, inter), 1 / math.sqrt(inter))
    w["model.norm.weight"] = norm_weight()
    if not spec.tie_embeddings:
        w["lm_head.weight"] = normal((vocab, h), 4 / math.sqrt(h))
    return w


def _config(spec: DemoSpec, vocab: int, eos_ids: list[int], bos_id: int | None) -> dict:
    cfg: dict = {
        "architectures": [get_arch(spec.arch).hf_class],
        "model_type": spec.arch,
        "vocab_size": vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden // spec.heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0],
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    if spec.arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif spec.arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers)
    else:  # demo_arch.py's architectures; a pad id inside this vocabulary (phi3's default is 32000)
        cfg.update(pad_token_id=eos_ids[0], **arch_fields(spec))
    return cfg


def _token_id(tok: Tokenizer, token: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise ValueError(f"the demo tokenizer has no {token!r}")
    return tid


_DEFAULT_SPEC = DemoSpec()  # frozen: one shared default is safe


def write_tokenizer(out: Path, vocab_size: int, bos: bool, max_len: int) -> tuple[int, list[int], int | None]:
    """tokenizer.json, tokenizer_config.json (and chat_template.jinja with `bos`) into `out`;
    returns (vocabulary size, EOS ids, BOS id). Also what tests write beside checkpoints that
    transformers creates (tests/arch_support.py)."""
    tok = train_tokenizer(vocab_size, bos)
    vocab = tok.get_vocab_size()  # the corpus may yield fewer merges than asked
    eos_ids = [_token_id(tok, EOS_TOKEN), _token_id(tok, IM_END)]
    bos_id = tok.token_to_id(BOS_TOKEN) if bos else None
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": BOS_TOKEN if bos else None,
        "unk_token": None,
        "add_bos_token": bos,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    if bos:  # transformers 5's layout: the template in its own file
        del tok_cfg["chat_template"]
        (out / "chat_template.jinja").write_text(BOS_CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return vocab, eos_ids, bos_id


def write_demo_model(out_dir: str | Path, spec: DemoSpec = _DEFAULT_SPEC) -> Path:
    """Write the checkpoint for `spec` into `out_dir` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, eos_ids, bos_id = write_tokenizer(out, spec.vocab, spec.bos, spec.max_position_embeddings)
    (out / "config.json").write_text(json.dumps(_config(spec, vocab, eos_ids, bos_id), indent=2) + "\n")
    gen_cfg = {"eos_token_id": eos_ids, "pad_token_id": eos_ids[0], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    if spec.arch in HAND_WRITTEN:
        weights = _weights(spec, vocab)
    else:
        weights = arch_weights(ModelConfig.from_dir(out), spec.seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
