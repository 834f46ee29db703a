"""`pipeserve router --models FILE`: several models (pipelines) behind one router.

FILE is YAML or JSON (YAML's superset): a list, one mapping per served model:

    - name: llama-8b            # kubernetes discovery: the InferencePipeline (in --namespace)
      model: llama-3-8b         # the served name: a request's `model`, an entry of /v1/models
      tokenizer: /models/llama-8b
      chatTemplate: /templates/llama.jinja   # optional; default: the tokenizer's own
      policy: prefix_affinity   # optional; default: --policy, else the pipeline's spec.router.policy
    - upstream: 10.0.0.7:50051  # static discovery (--discover static): stage 0 addresses instead
      model: qwen
      tokenizer: /models/qwen

Every entry is checked (config.ModelEntry) and every mistake is a ConfigError naming the entry and the
field (`models[1].policy: ...`): an unknown key, a missing one, two entries serving the same name, a
kubernetes entry without `name`, a static one without `upstream`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeserve.config import ModelEntry
from pipeserve.errors import ConfigError
from pipeserve.router.upstream.discovery import upstream_targets

# The file's keys -> ModelEntry's fields (camelCase like the chart's values and the CRD).
KEYS = {
    "name": "pipeline",
    "model": "model",
    "tokenizer": "tokenizer",
    "chatTemplate": "chat_template",
    "policy": "policy",
    "upstream": "upstream",
}
REQUIRED = ("model", "tokenizer")


def load_models(path: str, discover: str) -> list[ModelEntry]:
    """The entries of the file at `path` for discovery kind `discover` ("static" | "kubernetes")."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"models: cannot read {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"models: {path!r} is not YAML/JSON: {str(e)[:200]}") from None
    return parse_models(data, discover)


def parse_models(data: Any, discover: str) -> list[ModelEntry]:
    if not isinstance(data, list) or not data:
        raise ConfigError(f"models: must be a non-empty list of models (got {type(data).__name__})")
    entries: list[ModelEntry] = []
    for i, item in enumerate(data):
        entries.append(_entry(i, item, discover))
    seen: set[str] = set()
    for i, e in enumerate(entries):
        if e.model in seen:
            raise ConfigError(f"models[{i}].model: {e.model!r} is served by an earlier entry too")
        seen.add(e.model)
    return entries


def _entry(i: int, item: Any, discover: str) -> ModelEntry:
    where = f"models[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: must be a mapping (got {type(item).__name__})")
    unknown = sorted(set(item) - set(KEYS), key=str)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(KEYS)})")
    for key in REQUIRED:
        if key not in item:
            raise ConfigError(f"{where}.{key}: required")
    for key, value in item.items():
        if not isinstance(value, str):
            raise ConfigError(f"{where}.{key}: must be a string (got {value!r})")
    if discover == "kubernetes" and not item.get("name"):
        raise ConfigError(f"{where}.name: required with --discover kubernetes (the InferencePipeline)")
    if discover == "kubernetes" and "upstream" in item:
        raise ConfigError(f"{where}.upstream: is for --discover static only")
    if discover == "static":
        if "name" in item:
            raise ConfigError(f"{where}.name: is for --discover kubernetes only")
        try:
            upstream_targets(item.get("upstream"))
        except ConfigError as e:
            raise ConfigError(f"{where}.{e}") from None
    try:
        return ModelEntry(**{KEYS[k]: v for k, v in item.items()})
    except ConfigError as e:
        field, _, rest = str(e).partition(":")
        key = next((k for k, f in KEYS.items() if f == field), field)
        raise ConfigError(f"{where}.{key}:{rest}") from None
