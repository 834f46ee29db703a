"""`--model` as a new user gives it, against real `pipeserve up` processes (model_path.py):

* a path that does not exist, a directory that is no checkpoint, a file that is no GGUF, an
  architecture the loader refuses, a split the model cannot take: one line naming the problem (the
  loader's own text for the config), exit status CANNOT_START, no traceback, within seconds, and no
  stage or Redis started;
* a stage that fails at start without --log-dir is not pointed at a log that does not exist;
* `--model FILE.gguf`: converted once into $PIPESERVE_HOME keyed by the file's content, then served;
  its sampling metadata (temperature 0) makes a request without temperature greedy, token for token
  transformers' greedy, streamed or not, completions and chat; a request's own temperature wins;
  `--generation-config vllm` samples at 1.0 again; /v1/models shows max_model_len.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import gguf
import httpx
import openai
import pytest
import torch
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import hf_greedy
from gguf_support import write_llama_gguf
from pipeserve import model_path
from pipeserve.cli import build_parser, main
from pipeserve.errors import ExitCode, ModelLoadError
from pipeserve.model import gguf_blocks
from pipeserve.model.config import ModelConfig
from pipeserve.model.demo import DemoSpec, write_demo_model
from pipeserve.model.gguf import SAMPLING_KEYS
from pipeserve.model.gguf_cache import cached_gguf
from pipeserve.supervisor.up import build_configs
from serving_support import running_up

PROMPT = [5, 9, 14, 3, 27]
Q8 = gguf.GGMLQuantizationType.Q8_0
TOKENS = 6


def run_up(*args: str, home: Path, timeout_s: float = 60) -> tuple[int, str, float]:
    """`pipeserve up ARGS` to its exit: (status, stderr, seconds)."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "up", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PIPESERVE_HOME": str(home)},
    )
    return done.returncode, done.stderr, time.monotonic() - start


def assert_refused_before_start(status: int, err: str, seconds: float, limit_s: float) -> None:
    assert status == ExitCode.CANNOT_START, err
    assert "Traceback" not in err, err
    assert "started stages" not in err and "private redis-server" not in err, err  # launcher / L3
    assert seconds < limit_s, f"refused after {seconds:.1f}s"


def gpt2_dir(path: Path, llama_dir: Path) -> Path:
    """A tiny GPT-2 checkpoint by transformers itself (an architecture pipeserve does not serve)."""
    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=1024, n_positions=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    shutil.copy(llama_dir / "tokenizer.json", path)
    return path


def test_model_path_errors_before_anything_starts(tmp_path: Path, llama_dir: Path) -> None:
    home = tmp_path / "home"
    status, err, s = run_up("--model", str(tmp_path / "nope"), home=home)
    assert_refused_before_start(status, err, s, 5)
    assert f"--model {tmp_path / 'nope'}: does not exist" in err and "checkpoint directory" not in err
    (tmp_path / "empty").mkdir()
    shutil.copy(llama_dir / "tokenizer.json", tmp_path / "empty")
    (tmp_path / "empty" / "x.gguf").write_bytes(b"GGUF")
    status, err, s = run_up("--model", str(tmp_path / "empty"), home=home)
    assert_refused_before_start(status, err, s, 5)
    assert "lacks config.json, weights (model.safetensors or model.safetensors.index.json)" in err
    assert f"pass --model {tmp_path / 'empty' / 'x.gguf'}" in err
    status, err, s = run_up("--model", str(llama_dir / "config.json"), home=home)
    assert_refused_before_start(status, err, s, 5)
    assert "a file that is not a GGUF file" in err

    # The loader's own verdict (ModelConfig.from_dir), in its words, before any stage runs it.
    gpt2 = gpt2_dir(tmp_path / "gpt2", llama_dir)
    with pytest.raises(ModelLoadError) as refused:
        ModelConfig.from_dir(gpt2)
    status, err, s = run_up("--model", str(gpt2), home=home)
    assert_refused_before_start(status, err, s, 15)
    assert f"pipeserve: error: {refused.value}" in err
    status, err, s = run_up("--model", str(llama_dir), "--stages", "9", home=home)
    assert_refused_before_start(status, err, s, 15)
    assert "9 stages for" in err


def test_a_stage_that_fails_without_log_dir_is_not_sent_to_a_log(tmp_path: Path, llama_dir: Path) -> None:
    """Weights that lack a tensor pass every check before start; the stage refuses them and the
    supervisor's last line points at the output that holds the stage's error, not at a log."""
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, broken / "model.safetensors")
    status, err, _ = run_up("--model", str(broken), "--hicache-url", "off", home=tmp_path, timeout_s=180)
    assert status == ExitCode.CANNOT_START, err
    assert "model.norm.weight" in err  # the stage's own error, on the output it inherits
    last = [line for line in err.splitlines() if "cannot serve" in line][-1]
    assert "see its log" not in last and "the stage's error is in the output above" in last, last


def with_sampling(src: Path, dst: Path, **values: float) -> Path:
    """A copy of GGUF file `src` with llama.cpp's general.sampling.* keys (gguf-py's own copier)."""
    keys = {"temp": gguf.Keys.General.SAMPLING_TEMP}
    writer = gguf.GGUFWriter(dst, "llama")
    new = {keys[k]: MetadataDetails(gguf.GGUFValueType.FLOAT32, v) for k, v in values.items()}
    copy_with_new_metadata(gguf.GGUFReader(src), writer, new, [])
    return dst


def test_gguf_file_is_converted_once_and_served_with_its_defaults(tmp_path: Path, llama_dir: Path) -> None:
    home = tmp_path / "home"
    plain = write_llama_gguf(llama_dir, tmp_path / "plain.gguf")  # F32: served exactly
    model = with_sampling(plain, tmp_path / "demo.gguf", temp=0.0)
    greedy = hf_greedy(llama_dir, PROMPT, TOKENS, ignore_eos=True)
    env = {"PIPESERVE_HOME": str(home)}
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True}
    body |= {"seed": 3, "return_token_ids": True}
    with running_up("--model", str(model), "--num-kv-blocks", "256", log_dir=tmp_path / "a", env=env) as up:
        log = up.log()
        assert f"converting {model} into" in log and "Default sampling parameters" in log, log[-3000:]
        card = httpx.get(up.url + "/v1/models").json()["data"][0]
        assert card["id"] == str(model)
        assert (
            card["max_model_len"]
            == json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]
        )
        r = httpx.post(up.url + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["token_ids"] == greedy  # no temperature: the file's 0
        streamed: list[int] = []
        with httpx.stream("POST", up.url + "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["token_ids"]
        assert streamed == greedy
        hot = httpx.post(up.url + "/v1/completions", json={**body, "temperature": 1.0}, timeout=60).json()
        sampled = hot["choices"][0]["token_ids"]
        assert sampled != greedy  # the request's own value wins
        chat = {"model": str(model), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
        chat |= {"return_token_ids": True, "seed": 3}
        default = httpx.post(up.url + "/v1/chat/completions", json=chat, timeout=60).json()
        zero = httpx.post(up.url + "/v1/chat/completions", json={**chat, "temperature": 0}, timeout=60).json()
        assert default["choices"][0]["token_ids"] == zero["choices"][0]["token_ids"]
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0)
        text = client.completions.create(model=str(model), prompt="The", max_tokens=TOKENS).choices[0].text
        again = client.completions.create(model=str(model), prompt="The", max_tokens=TOKENS, temperature=0)
        assert text == again.choices[0].text
    (converted,) = (home / "gguf").glob("*-c*")
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    args = ("--model", str(model), "--num-kv-blocks", "256", "--generation-config", "vllm")
    with running_up(*args, log_dir=tmp_path / "b", env=env) as up:
        assert "converting" not in up.log() and "the conversion in" in up.log()
        r = httpx.post(up.url + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["token_ids"] == sampled  # no temperature: 1.0, the file's left out
    assert [p.name for p in (home / "gguf").glob("*-c*")] == [converted.name]
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_cache_key_is_the_files_content(
    tmp_path: Path, llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another file of the same name and size (other weights) is another conversion; the same bytes
    under another name are not converted again; the conversion shows its progress."""
    home = tmp_path / "home"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_llama_gguf(llama_dir, tmp_path / "a" / "m.gguf")
    reseeded = write_demo_model(tmp_path / "seed1", DemoSpec(arch="llama", seed=1))
    other = write_llama_gguf(reseeded, tmp_path / "b" / "m.gguf")
    assert first.stat().st_size == other.stat().st_size
    copy = tmp_path / "copy.gguf"
    shutil.copy(first, copy)
    with caplog.at_level(logging.INFO, "pipeserve.model"):
        converted = cached_gguf(first, home, progress_s=0.0)
    assert "converting m.gguf:" in caplog.text and "(100%)" in caplog.text  # a line per tensor here
    assert cached_gguf(copy, home) == converted
    again = cached_gguf(other, home)
    assert again != converted
    ours, theirs = (
        load_file(d / "model.safetensors")["model.embed_tokens.weight"] for d in (converted, again)
    )
    assert torch.equal(ours, load_file(llama_dir / "model.safetensors")["model.embed_tokens.weight"])
    assert not torch.equal(ours, theirs)
    assert len(list((home / "gguf").glob("*-c*"))) == 2


def test_stage_and_generate_check_the_model_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`stage` and `generate` say the same before a port, a rendezvous or a weight is touched."""
    nope = str(tmp_path / "nope")
    stage = ["stage", "--model", nope, "--rank", "0", "--world-size", "1", "--rendezvous-file", nope]
    for argv in (stage, ["generate", "--model", nope, "--prompt", "x"]):
        assert main(argv) == ExitCode.CANNOT_START
        assert f"pipeserve: error: --model {nope}: does not exist" in capsys.readouterr().err


def test_a_quantized_gguf_is_served_from_its_blocks_unless_asked(
    tmp_path: Path, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp serves a file as it is quantized: with no --quantization, up serves the file's
    blocks; an explicit --quantization (none included) wins; a checkpoint directory stays float."""
    attention = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")  # rows of 32s
    model = write_llama_gguf(
        llama_dir, tmp_path / "q8.gguf", quant=lambda n: Q8 if n.endswith(attention) else None
    )
    monkeypatch.setenv("PIPESERVE_HOME", str(tmp_path / "home"))
    for extra, want in (((), "gguf"), (("--quantization", "none"), "none")):
        args = build_parser().parse_args(["up", "--model", str(model), *extra])
        assert build_configs(args).engine.quantization == want
    args = build_parser().parse_args(["up", "--model", str(llama_dir)])
    assert build_configs(args).engine.quantization == "none"
    assert model_path.BLOCKS_FILE == gguf_blocks.BLOCKS_FILE
    general = gguf.Keys.General  # the keys llama.cpp writes, as gguf-py 0.19 names them
    sampling = (general.SAMPLING_TEMP, general.SAMPLING_TOP_K, general.SAMPLING_TOP_P, general.SAMPLING_MIN_P)
    assert set(SAMPLING_KEYS) == {*sampling, general.SAMPLING_PENALTY_REPEAT}


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path, llama_dir: Path) -> None:
    """A second server on the router's port: up used to start Redis and the stages, then fail to bind
    and leave a stage behind for 15-20 s."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pipeserve.cli", "up", "--model", str(llama_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PIPESERVE_HOME": str(tmp_path / "home")},
        )
    assert_refused_before_start(done.returncode, done.stderr, 0.0, 1)
    assert f"port: cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
