"""The demo checkpoint: deterministic, and loadable by transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeserve.cli import main
from pipeserve.model.demo import DemoSpec, write_demo_model


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_deterministic(tmp_path: Path) -> None:
    a = write_demo_model(tmp_path / "a", DemoSpec(layers=2))
    b = write_demo_model(tmp_path / "b", DemoSpec(layers=2))
    c = write_demo_model(tmp_path / "c", DemoSpec(layers=2, seed=1))
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_transformers_loads_model_and_tokenizer(qwen2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    tok = AutoTokenizer.from_pretrained(qwen2_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert 5e6 > sum(p.numel() for p in model.parameters()) > 2e6
    assert tok.decode(tok("Hello, world!").input_ids) == "Hello, world!"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    eos = json.loads((qwen2_dir / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos and tok.eos_token_id in eos


def test_cli_writes_model_and_generates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert (
        main(
            [
                "demo-model",
                str(out),
                "--layers",
                "2",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--kv-heads",
                "2",
            ]
        )
        == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64 and cfg["intermediate_size"] == 160
    assert (
        main(
            [
                "generate",
                "--model",
                str(out),
                "--prompt",
                "Hello",
                "--max-tokens",
                "5",
                "--kv-cache-gb",
                "0.01",
                "--quantization",
                "int4",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(json.loads(line)["token_ids"]) <= 5
    assert main(["generate", "--model", str(out), "--prompt", "Hello", "--max-tokens", "0"]) == 2
