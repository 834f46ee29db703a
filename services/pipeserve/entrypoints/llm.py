"""LLM: the offline API, shaped like vLLM's.

    llm = LLM(model="path/to/checkpoint")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids

A prompt is a string (tokenized with the checkpoint's tokenizer.json) or a
list of token ids. Stop strings are matched on the detokenized output here,
and the matched string and what follows are trimmed from the text.

With stages=S > 1 this process is stage 0 (scheduler, embedding, first
layers) and S-1 stage processes are started for the rest of the model; they
exit on `shutdown()`, on leaving a `with LLM(...)` block, when the LLM is
garbage-collected or the interpreter exits, when this process dies, and when
the group stops on an error (then generate() raises GroupStopped).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from tokenizers import Tokenizer

from pipeserve.config import EngineConfig
from pipeserve.engine.engine import LLMEngine
from pipeserve.engine.request import FinishReason, Request
from pipeserve.errors import GroupStopped, InvalidRequestError
from pipeserve.model.config import ModelConfig
from pipeserve.outputs import CompletionOutput, RequestOutput
from pipeserve.sampling_params import SamplingParams
from pipeserve.stage.launcher import LocalGroup, local_group_config
from pipeserve.stage.worker import layer_split

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, stages: int = 1, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        config = EngineConfig(model=model, stages=stages, **engine_args)
        self.group: LocalGroup | None = None
        if stages == 1:
            self.engine = LLMEngine(config)
        else:
            config = local_group_config(config)
            # A split that cannot work fails here, before any process is started.
            layer_split(config, ModelConfig.from_dir(config.model, config.dtype).num_layers)
            self.group = LocalGroup(config)
            self.group.start()
            try:
                self.engine = LLMEngine(config, self.group.rendezvous(0))
            except BaseException:
                self.group.stop(grace_s=2.0)
                raise
        self._finalizer = weakref.finalize(self, _shutdown, self.engine, self.group)
        tok_path = Path(model) / "tokenizer.json"
        self.tokenizer: Tokenizer | None = Tokenizer.from_file(str(tok_path)) if tok_path.is_file() else None

    def shutdown(self) -> None:
        """Stop the stage processes (no-op with one stage); idempotent."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "text prompts need tokenizer.json in the model directory")
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise InvalidRequestError("prompt", "must be a string or a list of token ids")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs are in prompt order.

        Invalid input raises InvalidRequestError before anything is queued.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompt_list):
            raise InvalidRequestError("sampling_params", "need one per prompt, or a single one")
        encoded = [self._encode(p) for p in prompt_list]
        for ids, p in zip(encoded, params, strict=True):
            self.engine.validate(ids, p)
        reqs: list[Request] = [
            self.engine.add_request(ids, p) for ids, p in zip(encoded, params, strict=True)
        ]
        texts: dict[str, str] = {}
        try:
            while self.engine.has_unfinished():
                self.engine.step()
                for req in reqs:
                    if req.params.stop and not req.is_finished and req.output_token_ids:
                        self._check_stop_strings(req, texts)
        except GroupStopped:
            self.shutdown()  # the other stages are exiting; reap them
            raise
        results = []
        for prompt, req in zip(prompt_list, reqs, strict=True):
            text = texts.get(req.req_id)
            if text is None:
                text = self._decode(req.output_token_ids)
                if req.params.stop:  # finished by a token in the same step a stop string appeared
                    text = _trim_stop(text, req.params.stop) or text
            results.append(
                RequestOutput(
                    request_id=req.req_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=req.prompt_token_ids,
                    outputs=[
                        CompletionOutput(
                            0,
                            text,
                            list(req.output_token_ids),
                            req.finish_reason.value if req.finish_reason else None,
                            list(req.output_logprobs) if req.params.logprobs is not None else None,
                        )
                    ],
                    num_cached_tokens=req.num_cached_prompt_tokens,
                )
            )
        return results

    def _check_stop_strings(self, req: Request, texts: dict[str, str]) -> None:
        trimmed = _trim_stop(self._decode(req.output_token_ids), req.params.stop)
        if trimmed is not None:
            texts[req.req_id] = trimmed
            self.engine.finish(req.req_id, FinishReason.STOP)


def _shutdown(engine: LLMEngine, group: LocalGroup | None) -> None:
    try:
        engine.shutdown()
    finally:
        if group is not None:
            group.stop()


def _trim_stop(text: str, stops: list[str]) -> str | None:
    """text cut before the earliest stop string, or None if none occurs."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return None if cut < 0 else text[:cut]
