"""Request defaults from the model's generation_config.json (request_defaults.py), as vLLM's
`--generation-config auto` reads them: transformers' own reader is the oracle; the router's parsers,
the offline LLM and `pipeserve generate` apply them under a request's own values; `vllm` turns them
off. The live server's side: tests/supervisor/test_up_model_path.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, GenerationConfig

from conftest import hf_greedy
from pipeserve import LLM, SamplingParams
from pipeserve.cli import main
from pipeserve.errors import ConfigError, ExitCode, ModelLoadError
from pipeserve.request_defaults import MODEL_KEYS, NO_DEFAULTS, load_defaults
from pipeserve.router.api.protocol import parse_chat, parse_completion
from pipeserve.sampling_fields import DEFAULT_MAX_TOKENS, FIELDS

USER = [{"role": "user", "content": "hi"}]


def with_generation_config(src: Path, dst: Path, **values: object) -> Path:
    """A copy of checkpoint `src` whose generation_config.json also holds `values`."""
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}, indent=2))
    return dst


def test_the_values_are_those_transformers_reads(tmp_path: Path, llama_dir: Path) -> None:
    """vLLM reads the file with GenerationConfig.from_pretrained(...).to_diff_dict(): the same values
    for every key of the list, an unset key (min_p here) and a null one left out, do_sample ignored."""
    d = with_generation_config(
        llama_dir,
        tmp_path / "m",
        temperature=0.6,
        top_p=0.95,
        top_k=20,
        repetition_penalty=1.05,
        max_new_tokens=40,
        min_p=None,
        do_sample=False,
    )
    hf = GenerationConfig.from_pretrained(d).to_diff_dict()
    want = {MODEL_KEYS[k]: v for k, v in hf.items() if k in MODEL_KEYS and v is not None}
    got = load_defaults(d)
    assert (
        got.values
        == want
        == {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "repetition_penalty": 1.05,
            "max_tokens": 40,
        }
    )
    assert "generation_config.json" in got.describe() and "--generation-config vllm" in got.describe()
    assert load_defaults(d, "vllm") is NO_DEFAULTS
    assert load_defaults(llama_dir).values == {}  # eos ids and do_sample only: nothing to apply
    assert load_defaults(llama_dir, str(d)).values == want  # a directory named by the flag


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
        ({"top_p": 0}, "top_p must be a finite number in (0, 1]"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"max_new_tokens": "many"}, "max_new_tokens must be an integer"),
        ({"temperature": True}, "temperature must be a number"),
    ],
)
def test_a_bad_value_fails_at_start_naming_the_key(
    tmp_path: Path, llama_dir: Path, values: dict, message: str
) -> None:
    d = with_generation_config(llama_dir, tmp_path / "m", **values)
    with pytest.raises(ModelLoadError) as e:
        load_defaults(d)
    assert message in str(e.value) and "generation_config.json" in str(e.value)
    assert load_defaults(d, "vllm") is NO_DEFAULTS  # the way out the message names
    with pytest.raises(ConfigError, match="generation_config"):
        load_defaults(d, "/no/such/dir")


def test_the_parsers_apply_them_under_the_request(tmp_path: Path, llama_dir: Path) -> None:
    d = with_generation_config(llama_dir, tmp_path / "m", temperature=0.0, top_k=5, max_new_tokens=8)
    defaults = load_defaults(d)
    plain = parse_completion({"prompt": "x"}, defaults)
    assert (plain.params.temperature, plain.params.top_k, plain.params.max_tokens) == (0.0, 5, 8)
    assert plain.max_tokens_from_model  # cut to the context, never refused
    own = parse_completion({"prompt": "x", "temperature": 0.7, "top_k": 3, "max_tokens": 30}, defaults)
    assert (own.params.temperature, own.params.top_k, own.params.max_tokens) == (0.7, 3, 30)
    assert not own.max_tokens_from_model
    assert parse_completion({"prompt": "x"}).params.temperature == FIELDS["temperature"].default
    chat = parse_chat({"messages": USER}, defaults)
    assert (chat.params.temperature, chat.params.max_tokens, chat.max_tokens_from_model) == (0.0, 8, True)
    assert parse_chat({"messages": USER, "max_completion_tokens": 3}, defaults).params.max_tokens == 3
    assert parse_chat({"messages": USER}).params.max_tokens is None  # chat's own: the context
    # max_new_tokens only lowers completions' 16 (vLLM takes the least); it is chat's whole default
    big = load_defaults(with_generation_config(llama_dir, tmp_path / "big", max_new_tokens=100))
    assert parse_completion({"prompt": "x"}, big).params.max_tokens == DEFAULT_MAX_TOKENS
    assert not parse_completion({"prompt": "x"}, big).max_tokens_from_model
    assert parse_chat({"messages": USER}, big).params.max_tokens == 100


def test_offline_llm_and_generate_sample_greedily_by_the_models_default(
    tmp_path: Path, llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """generation_config.json temperature 0: LLM.generate without SamplingParams and `pipeserve
    generate` without --temperature are greedy, token for token transformers' greedy."""
    d = with_generation_config(llama_dir, tmp_path / "m", temperature=0.0, max_new_tokens=6)
    prompt = [5, 9, 14, 3]
    want = hf_greedy(llama_dir, prompt, 6)
    with LLM(str(d), max_model_len=256, num_kv_blocks=64) as llm:
        assert llm.default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=6)
        assert llm.generate([prompt])[0].outputs[0].token_ids == want
    with LLM(str(d), max_model_len=256, num_kv_blocks=64, generation_config="vllm") as llm:
        assert llm.default_sampling_params() == SamplingParams()
    # generate's flags: not given -> the model's (temperature 0, max_tokens min(32, 6)); given -> theirs
    args = [
        "generate",
        "--model",
        str(d),
        "--prompt",
        "The",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
    ]
    ids = AutoTokenizer.from_pretrained(str(llama_dir))("The")["input_ids"]

    def generate(*flags: str) -> list[int]:
        assert main([*args, *flags]) == ExitCode.OK
        return json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"]

    assert generate() == hf_greedy(llama_dir, ids, 6)
    assert generate("--temperature", "1.0", "--seed", "3") != hf_greedy(llama_dir, ids, 6)
    # vllm: generate's own defaults (greedy, 32 tokens), the file's max_new_tokens left out
    longer = hf_greedy(llama_dir, ids, 32)
    assert len(longer) > 6 and generate("--generation-config", "vllm") == longer
