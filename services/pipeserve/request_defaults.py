"""Request defaults from the model: its generation_config.json's sampling values, as vLLM's
`--generation-config auto` applies them.

A sampling field a request leaves unset takes the model's default when it has one, else the
surface's own (sampling_fields.py: completions' max_tokens 16, chat's "up to the context",
`pipeserve generate`'s flags). A value the request sets always wins. The router (completions, chat,
streamed or not), the offline `LLM.generate(prompts)` without SamplingParams and `pipeserve generate`'s
flags not given apply them the same way.

* Which fields: those of the sampling field list with a `model_default` key (sampling_fields.py):
  temperature, top_p, top_k, min_p, repetition_penalty, and max_tokens from max_new_tokens (vLLM's
  list). Every non-null value the file holds counts: transformers 5's GenerationConfig has no
  defaults of its own, so `to_diff_dict` (vLLM's reader) keeps them all. `do_sample` is not read
  (vLLM does not: a file with do_sample false and temperature 0.6 samples at 0.6).
* max_tokens: the model's max_new_tokens bounds the surface's default, as vLLM takes the least of
  them: completions min(16, max_new_tokens), chat min(what the context leaves, max_new_tokens), a
  default the context cannot hold is cut to it, never refused. A request's own max_tokens is not
  cut by max_new_tokens (vLLM cuts it): the client's value wins, as for every other field.
* Where from (RouterConfig.generation_config, `--generation-config`): "auto" the model directory's
  generation_config.json (none: no defaults); "vllm" no model defaults; a directory: its
  generation_config.json. A GGUF file's sampling metadata (llama.cpp's `general.sampling.*`) comes
  through the generation_config.json model/gguf.py writes when it converts the file.
* A value of the wrong type or out of its field's bounds is a ModelLoadError at start-up naming the
  file and the key, never a failure of every request.

Imports neither torch nor transformers: the router's image has neither.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeserve.config import GENERATION_CONFIG_RULE, generation_config_ok
from pipeserve.errors import ConfigError, InvalidRequestError, ModelLoadError
from pipeserve.sampling_fields import FIELDS, SAMPLING_FIELDS
from pipeserve.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's key -> the SamplingParams field whose default it is
MODEL_KEYS = {f.model_default: f.name for f in SAMPLING_FIELDS if f.model_default}


@dataclass(frozen=True)
class RequestDefaults:
    values: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> the model's default
    source: str = ""  # the file they were read from

    def value(self, name: str, surface_default: Any) -> Any:
        """The default of field `name` on a surface whose own default is `surface_default`."""
        if name not in self.values:
            return surface_default
        model = self.values[name]
        if name == "max_tokens" and surface_default is not None:
            return min(surface_default, model)
        return model

    def from_model(self, name: str, surface_default: Any) -> bool:
        """Whether the model's value, not the surface's, is field `name`'s default there."""
        return name in self.values and self.value(name, surface_default) != surface_default

    def sampling_params(self) -> SamplingParams:
        """The offline API's default SamplingParams (vLLM's LLM.get_default_sampling_params)."""
        return SamplingParams(**{n: self.value(n, FIELDS[n].default) for n in self.values})

    def describe(self) -> str:
        """The start-up line, once per model (vLLM's wording)."""
        shown = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
        return (
            f"Default sampling parameters have been overridden by the model's Hugging Face generation "
            f"config ({self.source}): {shown}; a request's own values win. If this is not intended, "
            f"relaunch with `--generation-config vllm`."
        )


NO_DEFAULTS = RequestDefaults()


def load_defaults(model_dir: str | Path, mode: str = "auto") -> RequestDefaults:
    """The model's request defaults under `mode` (see the module docstring)."""
    if not generation_config_ok(mode):
        raise ConfigError(f"generation_config: {GENERATION_CONFIG_RULE} (got {mode!r})")
    if mode == "vllm":
        return NO_DEFAULTS
    path = Path(model_dir if mode == "auto" else mode) / GENERATION_CONFIG_FILE
    if not path.is_file():
        if mode != "auto":
            raise ConfigError(f"generation_config: {path} does not exist")
        return NO_DEFAULTS
    try:
        raw = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    values: dict[str, Any] = {
        name: _typed(path, key, raw[key], FIELDS[name].type)
        for key, name in MODEL_KEYS.items()
        if raw.get(key) is not None
    }
    try:
        SamplingParams(**values)  # the fields' bounds, checked once here, not on every request
    except InvalidRequestError as e:
        key = next((k for k, n in MODEL_KEYS.items() if n == e.param), e.param)
        raise ModelLoadError(
            f"{path}: {key} {e.message}; --generation-config vllm ignores the file"
        ) from None
    return RequestDefaults(values, str(path)) if values else NO_DEFAULTS


def _typed(path: Path, key: str, v: Any, kind: Any) -> int | float:
    """A JSON number as the field's type: an integer field takes an integral value (40 or 40.0)."""
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(_float(v))
    if ok and kind in (int, int | None):
        ok = float(v).is_integer()
        v = int(v) if ok else v
    if not ok:
        what = "an integer" if kind in (int, int | None) else "a number"
        raise ModelLoadError(f"{path}: {key} must be {what}, got {v!r}")
    return v if kind in (int, int | None) else float(v)


def _float(v: int | float) -> float:
    try:
        return float(v)
    except OverflowError:  # an integer of hundreds of digits
        return math.inf
