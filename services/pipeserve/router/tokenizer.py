"""The router's name for pipeserve.tokenizer (the tokenizer moved there: the offline LLM uses it too)."""

from pipeserve.tokenizer import TemplateError, TokenizerAssets

__all__ = ["TemplateError", "TokenizerAssets"]
