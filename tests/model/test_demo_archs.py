"""`pipeserve demo-model --arch A` for every registered architecture (the registry's list, nothing
else): a tiny checkpoint transformers loads with every tensor in place, on which pipeserve's greedy
ids are transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import hf_greedy, random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.cli import build_parser, main
from pipeserve.model.arch import REGISTRY, get_arch
from pipeserve.model.demo import DemoSpec

TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "64", "--heads", "4", "--kv-heads", "2"]
PROMPT = random_prompts(1, 24, 24, 1024, seed=81)[0]


@pytest.mark.parametrize("arch", list(REGISTRY))
def test_demo_model_of_every_arch_is_transformers_exact(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / arch
    assert main(["demo-model", str(out), "--arch", arch, *TINY]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == get_arch(arch).hf_class
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    with LLM(str(out), max_model_len=64, num_kv_blocks=16) as llm:
        got = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert got[0].outputs[0].token_ids == hf_greedy(out, PROMPT, 6, ignore_eos=True)


def test_the_cli_offers_the_registry_and_refuses_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert [parser.parse_args(["demo-model", "d", "--arch", a]).arch for a in REGISTRY] == list(REGISTRY)
    with pytest.raises(SystemExit) as exit_:
        main(["demo-model", "d", "--arch", "gpt2"])
    assert exit_.value.code == 2 and "invalid choice: 'gpt2'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"arch must be one of .*'mixtral'"):
        DemoSpec(arch="gpt2")
