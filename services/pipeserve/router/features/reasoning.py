"""`--reasoning-parser`: a chat choice's text split into reasoning and content (vLLM's parsers).

`qwen3` and `deepseek_r1` models think between `<think>` and `</think>`; their chat templates may
write the `<think>` into the prompt (Qwen3's newer templates, DeepSeek-R1's), so generation often
starts inside the thinking with no start tag. The rules (vLLM's `BaseThinkingReasoningParser` and
its qwen3 / deepseek_r1 subclasses, for the text they see):
* Thinking on: the text up to the first `</think>` is reasoning, the rest is content, verbatim
  (no whitespace trimmed: Qwen3's "\\n\\n" after `</think>` is the content's). The first `<think>`
  before it is dropped (the model wrote its own start tag). No `</think>` at all: all of it is
  reasoning (the output was cut while thinking).
* Thinking off: everything is content. Only `qwen3` can be switched off, by the request's
  `chat_template_kwargs: {"enable_thinking": false}` (its template then writes an empty
  `<think></think>` into the prompt); vLLM's qwen3 parser reads the same kwarg.
Streaming gives the same split however the text is cut: a suffix that may still become a tag is
held until it cannot (at the end it is reasoning). Tool calls are parsed in the content only
(router/api/chat_output.py).

vLLM differs in one corner: its blocking parser drops text before a `<think>` that is not at the
start, its streaming one keeps it as reasoning; here it is reasoning both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

START = "<think>"
END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    switch: str | None = None  # the chat_template_kwargs key that turns thinking off when false

    @property
    def tags(self) -> tuple[str, ...]:
        """Text the detokenizer must keep even when the tokenizer marks it special."""
        return (START, END)

    def thinking(self, template_kwargs: dict) -> bool:
        # Truthiness, as vLLM's qwen3 parser tests `enable_thinking` (default on).
        return self.switch is None or bool(template_kwargs.get(self.switch, True))


# The registry; its names equal config.REASONING_PARSERS (the flag's choices; a test checks).
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1"),
    "qwen3": ReasoningFormat("qwen3", switch="enable_thinking"),
}


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class ReasoningSplitter:
    """One choice's text, pushed in pieces, as (reasoning, content) pieces (see the module rules)."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking  # inside the reasoning now
        self._started = False  # a start tag was dropped (later ones are reasoning text)
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        buf = self._held + text
        self._held = ""
        reasoning: list[str] = []
        while True:
            tags = (END,) if self._started else (START, END)
            found = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
            if not found:
                break
            at, tag = min(found)
            reasoning.append(buf[:at])
            buf = buf[at + len(tag) :]
            if tag == END:
                self.thinking = False
                return "".join(reasoning), buf
            self._started = True
        keep = _held(buf, (END,) if self._started else (START, END))
        if keep:
            buf, self._held = buf[:-keep], buf[-keep:]
        reasoning.append(buf)
        return "".join(reasoning), ""

    def finish(self) -> str:
        """The reasoning still held (a cut-off tag is reasoning text)."""
        held, self._held = self._held, ""
        return held


def split(text: str, thinking: bool) -> tuple[str, str]:
    """A whole text's (reasoning, content)."""
    s = ReasoningSplitter(thinking)
    reasoning, content = s.push(text)
    return reasoning + s.finish(), content
