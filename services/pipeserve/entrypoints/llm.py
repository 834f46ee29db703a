"""LLM: the offline API, shaped like vLLM's.

    llm = LLM(model="path/to/checkpoint")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids

A prompt is a string or a list of token ids. A string is encoded as the
router's /v1/completions encodes it by default: with the tokenizer's own
special tokens (its post-processor's BOS), as transformers' `tokenizer(text)`.
Output is detokenized incrementally by the router's TextStream (one token at
a time, linear in the output): a stop string finishes the request at the
step that completed it, and it and what follows are trimmed from the text.
`max_tokens=None` generates up to the context. `generate(prompts)` without SamplingParams samples
with the model's defaults (its generation_config.json, request_defaults.py) over SamplingParams()'s,
as vLLM's LLM does; `generation_config="vllm"` leaves the model's out.

With stages=S > 1 this process is stage 0 (scheduler, embedding, first
layers) and S-1 stage processes are started for the rest of the model; they
exit on `shutdown()`, on leaving a `with LLM(...)` block, when the LLM is
garbage-collected or the interpreter exits, when this process dies, and when
the group stops on an error (then generate() raises GroupStopped).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self, cast

from pipeserve.config import EngineConfig
from pipeserve.detokenize import TextStream
from pipeserve.engine.engine import LLMEngine
from pipeserve.engine.request import FinishReason, Request
from pipeserve.errors import GroupStopped, InvalidRequestError
from pipeserve.local.launcher import LocalGroup, local_group_config
from pipeserve.local.redis_server import LocalRedis
from pipeserve.model.config import ModelConfig
from pipeserve.outputs import CompletionOutput, RequestOutput
from pipeserve.request_defaults import load_defaults
from pipeserve.sampling_params import SamplingParams, resolve_max_tokens
from pipeserve.stage.assemble import build_engine, layer_split
from pipeserve.tokenizer import TokenizerAssets

Prompt = str | list[int]
log = logging.getLogger("pipeserve.llm")


class LLM:
    def __init__(
        self, model: str, stages: int = 1, generation_config: str = "auto", **engine_args: Any
    ) -> None:
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        config = EngineConfig(model=model, stages=stages, **engine_args)
        # RouterConfig.generation_config's modes; checked (and the file read) before any process starts
        self.defaults = load_defaults(model, generation_config)
        if self.defaults.values:
            log.info("%s", self.defaults.describe())
        self.group: LocalGroup | None = None
        self.redis: LocalRedis | None = None
        if config.hicache_url == "local":  # a private redis-server for this LLM's L3
            self.redis = LocalRedis(maxmemory_mb=config.hicache_local_maxmemory_mb or None).start()
            config = dataclasses.replace(config, hicache_url=self.redis.url)
        if stages == 1:
            self.engine = build_engine(config)
        else:
            config = local_group_config(config)
            # A split that cannot work fails here, before any process is started.
            layer_split(config, ModelConfig.from_dir(config.model, config.dtype))
            self.group = LocalGroup(config)
            self.group.start()
            try:
                self.engine = build_engine(config, self.group.rendezvous(0))
            except BaseException:
                self.group.stop(grace_s=2.0)
                raise
        self._finalizer = weakref.finalize(self, _shutdown, self.engine, self.group, self.redis)
        has_tokenizer = (Path(model) / "tokenizer.json").is_file()
        self.tok: TokenizerAssets | None = TokenizerAssets.load(model) if has_tokenizer else None

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's defaults over
        SamplingParams()'s (vLLM's get_default_sampling_params)."""
        return self.defaults.sampling_params()

    def shutdown(self) -> None:
        """Stop the stage processes (no-op with one stage); idempotent."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tok is None:
                raise InvalidRequestError("prompt", "text prompts need tokenizer.json in the model directory")
            try:
                return self.tok.encode(prompt, add_special_tokens=True)
            except UnicodeEncodeError as e:
                raise InvalidRequestError(
                    "prompt", f"contains a lone surrogate at character {e.start}"
                ) from None
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise InvalidRequestError("prompt", "must be a string or a list of token ids")

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids) if self.tok else ""

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs are in prompt order.

        Invalid input raises InvalidRequestError before anything is queued.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompt_list):
            raise InvalidRequestError("sampling_params", "need one per prompt, or a single one")
        encoded = [self._encode(p) for p in prompt_list]
        max_len = self.engine.max_model_len
        params = [
            p
            if p.max_tokens is not None
            else dataclasses.replace(p, max_tokens=resolve_max_tokens(p, len(ids), max_len, strict=False))
            for ids, p in zip(encoded, params, strict=True)
        ]
        for ids, p in zip(encoded, params, strict=True):
            self.engine.validate(ids, p)
        reqs: list[Request] = [
            self.engine.add_request(ids, p) for ids, p in zip(encoded, params, strict=True)
        ]
        streams = [
            _Output(req, TextStream(self._decode, req.params.stop, req.params.min_tokens)) for req in reqs
        ]
        self._run(streams)
        return [_request_output(prompt, out) for prompt, out in zip(prompt_list, streams, strict=True)]

    def _run(self, streams: list[_Output]) -> None:
        """Step the engine until every request is finished; a stop string ends its request."""
        try:
            while self.engine.has_unfinished():
                self.engine.step()
                for out in streams:  # without stop strings the text is only needed at the end
                    if out.req.params.stop and out.feed() and not out.req.is_finished:
                        self.engine.finish(out.req.req_id, FinishReason.STOP)
        except GroupStopped:
            self.shutdown()  # the other stages are exiting; reap them
            raise


def _request_output(prompt: Prompt, out: _Output) -> RequestOutput:
    req = out.req
    return RequestOutput(
        request_id=req.req_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[
            CompletionOutput(
                0,
                out.finish(),
                list(req.output_token_ids),
                req.finish_reason.value if req.finish_reason else None,
                list(req.output_logprobs) if req.params.logprobs is not None else None,
            )
        ],
        num_cached_tokens=req.num_cached_prompt_tokens,
        prompt_logprobs=[None, *req.prompt_scores] if req.params.prompt_logprobs is not None else None,
    )


class _Output:
    """One request's text, fed token by token after each step (linear in the output length)."""

    def __init__(self, req: Request, text: TextStream) -> None:
        self.req = req
        self.text = text
        self.fed = 0  # output tokens pushed so far

    def feed(self) -> bool:
        """Push the tokens produced since the last call; True once a stop string has appeared."""
        ids = self.req.output_token_ids
        while self.fed < len(ids) and not self.text.stopped:
            self.text.push(ids[self.fed])
            self.fed += 1
        return self.text.stopped

    def finish(self) -> str:
        if not self.feed():
            self.text.finish()
        return self.text.text


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or a list of token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [cast(Prompt, prompts)]
    return list(cast(Sequence[Prompt], prompts))


def _shutdown(engine: LLMEngine, group: LocalGroup | None, redis: LocalRedis | None) -> None:
    try:
        engine.shutdown()
    finally:
        if group is not None:
            group.stop()
        if redis is not None:
            redis.stop()
