"""`--model` as a user gives it, checked before any process starts (`up`, `stage`, `generate`).

    model = resolve_model(args.model)          # the checkpoint directory to serve (or a ModelLoadError)
    check_files(model.dir, tokenizer=True)      # the files a checkpoint directory needs
    check_config(engine)            # in this process (it imports torch), or
    check_config_in_child(engine)   # in a child: `pipeserve up` never imports torch

* None: the default model (model/default.py), converted on first use.
* A path that does not exist says so.
* A GGUF file (by its magic bytes, whatever its suffix) is converted once into the cache
  (model/gguf_cache.py) and served from there; `default_quantization` then serves its own blocks,
  as llama.cpp does, when the user chose no --quantization and the conversion kept them.
* Any other file, or a directory without config.json / weights / tokenizer.json, is named with what
  is missing (a directory holding a .gguf file is pointed at it).
* The architecture and config are checked by the loader's own parser, `ModelConfig.from_dir`
  (model/config.py): its ModelLoadError is the message, nothing here restates its rules; the layer
  split and max_model_len are checked against the model by stage/assemble.py's own functions.
The CLI prints a ModelLoadError / ConfigError as one line and exits ExitCode.CANNOT_START (cli.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import xxhash

from pipeserve.config import EngineConfig, add_config_args, config_argv, config_from_args
from pipeserve.errors import ConfigError, ExitCode, ModelLoadError
from pipeserve.model.gguf_cache import cached_gguf, is_gguf

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# model/gguf_blocks.py's BLOCKS_FILE (that module imports torch; a test checks they agree)
BLOCKS_FILE = "quantized.safetensors"
CHECK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ModelPath:
    dir: Path  # the checkpoint directory every process serves
    gguf: Path | None = None  # the GGUF file it was converted from, when --model named one


def resolve_model(model: str | None, home: Path | None = None) -> ModelPath:
    if not model:  # None or "" (an empty PIPESERVE_MODEL): the default model
        from pipeserve.model.default import default_model

        return ModelPath(default_model(home))
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"--model {model}: does not exist")
    if path.is_file():
        if is_gguf(path):
            return ModelPath(cached_gguf(path, home), path)
        raise ModelLoadError(
            f"--model {model}: a file that is not a GGUF file; --model takes a checkpoint directory "
            f"(config.json, {WEIGHTS[0]}, tokenizer.json) or a .gguf file"
        )
    if not path.is_dir():
        raise ModelLoadError(f"--model {model}: neither a checkpoint directory nor a .gguf file")
    return ModelPath(path)


def check_files(model_dir: Path, tokenizer: bool) -> None:
    """What a checkpoint directory must hold: config.json, its weights, tokenizer.json (`tokenizer`:
    for a router or text prompts). One ModelLoadError names everything missing."""
    missing = [] if (model_dir / "config.json").is_file() else ["config.json"]
    if not any((model_dir / w).is_file() for w in WEIGHTS):
        missing.append(f"weights ({' or '.join(WEIGHTS)})")
    if tokenizer and not (model_dir / "tokenizer.json").is_file():
        missing.append("tokenizer.json")
    if not missing:
        try:
            json.loads((model_dir / "config.json").read_text("utf-8"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"--model {model_dir}: config.json is not readable JSON ({e})") from None
        return
    ggufs = sorted(model_dir.glob("*.gguf"))
    hint = f"; it holds {ggufs[0].name}: pass --model {ggufs[0]}" if ggufs else ""
    raise ModelLoadError(
        f"--model {model_dir}: not an HF-layout checkpoint directory, it lacks {', '.join(missing)}{hint}"
    )


def default_quantization(model: ModelPath, asked: str | None) -> str:
    """--quantization as given; not given: a GGUF file's own blocks where its conversion kept them
    (llama.cpp serves a file as it is quantized), else none (the float checkpoint)."""
    if asked is not None:
        return asked
    return "gguf" if model.gguf is not None and (model.dir / BLOCKS_FILE).is_file() else "none"


def check_config(engine: EngineConfig) -> None:
    """The loader's own config parse, the layer split and max_model_len against the model, in this
    process (imports torch)."""
    from pipeserve.model.config import ModelConfig
    from pipeserve.stage.assemble import layer_split, resolve_max_model_len

    cfg = ModelConfig.from_dir(engine.model, engine.dtype)
    layer_split(engine, cfg)
    resolve_max_model_len(engine, cfg)


def check_config_in_child(engine: EngineConfig, home: Path | None = None) -> None:
    """check_config in a child interpreter: `pipeserve up` never imports torch (~2 s and 0.2 GB that
    would stay for its whole life); the child costs the import once, before anything starts.

    A check that passed is remembered (a marker under $PIPESERVE_HOME/checks named by everything
    the verdict depends on: config.json, the flags, the interpreter and the package's code), so a
    restart of the same model does not pay the child's torch import again: it was a second
    `import torch` in series with the stages' own, 1.5-2.3 s of every start-up."""
    argv = [sys.executable, "-m", "pipeserve.model_path", "--model", engine.model]
    argv += ["--stages", str(engine.stages), *config_argv(engine)]
    marker = _passed_marker(engine, argv, home)
    if marker is not None and marker.is_file():
        return
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"checking {engine.model}'s config took over {CHECK_TIMEOUT_S:.0f}s") from None
    if done.returncode == ExitCode.OK:
        if marker is not None:
            with contextlib.suppress(OSError):  # a read-only home only loses the shortcut
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
        return
    lines = done.stderr.strip().splitlines()
    message = lines[-1] if lines else f"exit status {done.returncode}"
    kind, _, text = message.partition(": ")
    if done.returncode == ExitCode.CANNOT_START and kind in ("ConfigError", "ModelLoadError"):
        raise (ConfigError if kind == "ConfigError" else ModelLoadError)(text)
    raise ModelLoadError(f"checking {engine.model}'s config failed: {message}")


def _passed_marker(engine: EngineConfig, argv: list[str], home: Path | None) -> Path | None:
    """Where a passed check of exactly these inputs is remembered; None if config.json is unreadable
    (the child then says why). Only passes are remembered: a failure is checked again each time."""
    from pipeserve.model.default import pipeserve_home

    try:
        config = (Path(engine.model) / "config.json").read_bytes()
    except OSError:
        return None
    package = Path(__file__).resolve().parent
    code = [(str(f.relative_to(package)), f.stat().st_mtime_ns) for f in sorted(package.rglob("*.py"))]
    key = xxhash.xxh3_128_hexdigest(repr((config, argv[1:], sys.version, code)).encode())
    return (home or pipeserve_home()) / "checks" / key


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeserve.model_path")
    parser.add_argument("--model", required=True)
    add_config_args(parser, EngineConfig, skip={"model", "log_dir"})  # --stages included
    args = parser.parse_args(argv)
    try:
        check_config(config_from_args(EngineConfig, args, model=args.model, stages=args.stages))
    except (ModelLoadError, ConfigError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return ExitCode.CANNOT_START
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
