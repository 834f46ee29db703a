"""OpenAI response bodies and stream chunks, for /v1/completions and /v1/chat/completions.

`Formatter` builds every JSON object one request sends, so a streamed and a
blocking response of the same request carry the same id, `created` and model:
* completions: `object: "text_completion"` for both responses and chunks;
  logprobs in the legacy shape {tokens, token_logprobs, top_logprobs (dicts
  holding the top k plus the sampled token), text_offset}.
* chat: `chat.completion` / `chat.completion.chunk`; the first chunk of each
  choice has `delta.role = "assistant"`; logprobs as {content: [{token,
  logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
* the usage chunk (stream_options.include_usage) has `choices: []`.
* chat with tools or a reasoning parser (`Formatter.output`, router/api/chat_output.py):
  messages and deltas carry `reasoning_content` and `tool_calls`; a chunk whose
  text the parsers hold back is not sent.
Logprobs that are not finite are sent as -9999.0 (JSON has no -inf).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from pipeserve.router.api.chat_output import ChatOutput
from pipeserve.router.api.protocol import ChatRequest, CompletionRequest
from pipeserve.router.api.results import ChoiceResult, TokenLP
from pipeserve.router.features import echo as prompt_side
from pipeserve.tokenizer import TokenizerAssets

__all__ = ["ChoiceResult", "Formatter", "TokenLP", "chat_formatter", "completion_formatter", "sse", "usage"]
MIN_LOGPROB = -9999.0


def usage(results: list[ChoiceResult]) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class Formatter:
    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        tok: TokenizerAssets,
        logprobs: bool,
        return_token_ids: bool = False,
        echo: bool = False,
        prompt_logprobs: int | None = None,
        logprobs_k: int = 0,
    ) -> None:
        self.chat = chat
        self.echo = echo  # completions: the prompt first (router/features/echo.py)
        self.prompt_logprobs = prompt_logprobs  # k, or None: not asked
        self.logprobs_k = logprobs_k
        self._shift: dict[int, int] = {}  # echo: characters of prompt before each choice's text
        self.return_token_ids = return_token_ids
        self.id = request_id
        self.model = model
        self.tok = tok
        self.logprobs = logprobs
        self.created = int(time.time())
        self.output: ChatOutput | None = None  # chat with tools to parse or a reasoning parser

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # --- logprobs --------------------------------------------------------------
    def _completion_logprobs(self, tokens: list[TokenLP]) -> dict:
        text = self.tok.token_text
        tops = []
        for t in tokens:
            d = {text(i): _lp(v) for i, v in t.top}
            d.setdefault(text(t.token_id), _lp(t.logprob))
            tops.append(d)
        return {
            "tokens": [text(t.token_id) for t in tokens],
            "token_logprobs": [_lp(t.logprob) for t in tokens],
            "top_logprobs": tops,
            "text_offset": [t.offset for t in tokens],
        }

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {
            "token": self.tok.token_text(token_id),
            "logprob": _lp(logprob),
            "bytes": list(self.tok.token_bytes(token_id)),
        }

    def _chat_logprobs(self, tokens: list[TokenLP]) -> dict:
        content = []
        for t in tokens:
            entry = self._entry(t.token_id, t.logprob)
            entry["top_logprobs"] = [self._entry(i, v) for i, v in t.top]
            content.append(entry)
        return {"content": content}

    def _logprobs(self, tokens: list[TokenLP]) -> dict | None:
        if not self.logprobs:
            return None
        return self._chat_logprobs(tokens) if self.chat else self._completion_logprobs(tokens)

    def _prompt_logprobs(self, r: ChoiceResult) -> list | None:
        k = self.prompt_logprobs
        return (
            None
            if k is None
            else prompt_side.prompt_logprobs(self.tok, r.prompt_token_ids, r.prompt_scores, k, _lp)
        )

    def _echo_logprobs(self, r: ChoiceResult) -> dict | None:
        if not self.logprobs:
            return None
        return prompt_side.legacy_prompt_logprobs(
            self.tok, r.prompt_token_ids, r.prompt_scores, self.logprobs_k, _lp
        )

    def _completion_choice(self, r: ChoiceResult) -> dict[str, Any]:
        text, logprobs = r.text, self._logprobs(r.tokens)
        if self.echo:
            text = r.prompt_text + r.text
            prompt = self._echo_logprobs(r)
            if prompt is not None:
                logprobs = prompt_side.join_legacy(prompt, logprobs, len(r.prompt_text))
        choice: dict[str, Any] = {"index": r.index, "text": text, "logprobs": logprobs}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(r)
        return choice

    # --- streaming -------------------------------------------------------------
    def role_chunk(self, index: int, r: ChoiceResult | None = None) -> dict | None:
        """The chunk that opens a choice: chat's role (and prompt_logprobs at the top level);
        completions' echoed prompt and/or prompt_logprobs, when asked (else None)."""
        if not self.chat:
            if r is None or not (self.echo or self.prompt_logprobs is not None):
                return None
            self._shift[index] = len(r.prompt_text) if self.echo else 0
            opening = self._completion_choice(dataclasses.replace(r, text="", tokens=[]))
            return self._envelope("text_completion", [{**opening, "finish_reason": None}])
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        out = self._envelope("chat.completion.chunk", [{**choice, "finish_reason": None}])
        if self.prompt_logprobs is not None and r is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(r)
        return out

    def chunk(
        self,
        index: int,
        text: str,
        tokens: list[TokenLP],
        finish_reason: str | None,
        token_ids: list[int] | None = None,
    ) -> dict | None:
        ids: dict[str, list[int]] = {"token_ids": token_ids or []} if self.return_token_ids else {}
        if self.chat:
            if self.output is not None:
                delta, finish_reason = self.output.delta(index, text, finish_reason)
                if not delta and finish_reason is None and not tokens and not (ids and token_ids):
                    return None
            else:
                delta = {"content": text} if text or finish_reason is None else {}
            chat: dict[str, Any] = {"index": index, "delta": delta, "logprobs": self._logprobs(tokens), **ids}
            return self._envelope("chat.completion.chunk", [{**chat, "finish_reason": finish_reason}])
        if shift := self._shift.get(index, 0):  # echo: offsets count the echoed prompt
            tokens = [dataclasses.replace(t, offset=t.offset + shift) for t in tokens]
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": self._logprobs(tokens), **ids}
        return self._envelope("text_completion", [{**choice, "finish_reason": finish_reason}])

    def usage_chunk(self, results: list[ChoiceResult]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(results)}

    # --- blocking --------------------------------------------------------------
    def response(self, results: list[ChoiceResult]) -> dict:
        choices = []
        for r in sorted(results, key=lambda r: r.index):
            finish = r.finish_reason
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": r.text}
                if self.output is not None:
                    message, finish = self.output.message(r.text, finish)
                choice = {"index": r.index, "message": message, "logprobs": self._logprobs(r.tokens)}
            else:
                choice = self._completion_choice(r)
            if self.return_token_ids:
                choice |= {"token_ids": r.token_ids, "prompt_token_ids": r.prompt_token_ids}
            choices.append({**choice, "finish_reason": finish})
        obj = "chat.completion" if self.chat else "text_completion"
        body = {**self._envelope(obj, choices), "usage": usage(results)}
        if self.chat and self.prompt_logprobs is not None and results:  # vLLM: top level for chat
            body["prompt_logprobs"] = self._prompt_logprobs(results[0])
        return body


def completion_formatter(
    req: CompletionRequest, rid: str, model_name: str, tok: TokenizerAssets
) -> Formatter:
    """A completion's Formatter: the legacy logprobs shape, echo's prompt side."""
    return Formatter(
        False,
        rid,
        model_name,
        tok,
        req.params.logprobs is not None,
        req.return_token_ids,
        req.echo,
        req.prompt_logprobs,
        req.params.logprobs or 0,
    )


def chat_formatter(
    req: ChatRequest, rid: str, model_name: str, tok: TokenizerAssets, output: ChatOutput | None
) -> Formatter:
    """A chat completion's Formatter; `output`: the tool-call and reasoning parsers, if any."""
    fmt = Formatter(
        True,
        rid,
        model_name,
        tok,
        req.params.logprobs is not None,
        req.return_token_ids,
        prompt_logprobs=req.params.prompt_logprobs,
    )
    fmt.output = output
    return fmt
