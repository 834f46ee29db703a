"""EngineConfig: every engine and pipeline-group setting, validated in one place.

Invalid values raise ConfigError (a ValueError) naming the field. The same
fields are the flags of `pipeserve stage` (`--max-num-seqs` ...), built from
this class by `add_config_args`, so a launcher turns a config back into the
argv of a stage process with `config_argv` and nothing is listed twice
(StageServeConfig and RouterConfig work the same way).
Environment variables use the PIPESERVE_ prefix and are read by the CLI.
"""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from pipeserve.errors import ConfigError
from pipeserve.sampling_fields import SAMPLING_FIELDS

DEVICES = ("cpu", "cuda")
# Weight-only quantization of the decoder projections (model/quant.py): none is HF-exact; int8/int4
# quantize a float checkpoint; gguf serves a converted GGUF's own blocks (model/gguf_blocks.py).
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# Which full blocks stage 0 orders written to L3 (engine/l3_writes.py, docs/hicache.md).
HICACHE_WRITE_POLICIES = ("second-hit", "always")
T = TypeVar("T")
# Where requests' default sampling values come from (request_defaults.py), vLLM's --generation-config:
# auto: the model's generation_config.json; vllm: none from the model; or a directory holding one.
GENERATION_CONFIG_MODES = ("auto", "vllm")
MODEL_DEFAULTED = tuple(f.name for f in SAMPLING_FIELDS if f.model_default)  # the fields it sets
GENERATION_CONFIG_RULE = (
    f"must be {' or '.join(GENERATION_CONFIG_MODES)} or a directory holding generation_config.json"
)


def generation_config_ok(mode: str) -> bool:
    return mode in GENERATION_CONFIG_MODES or Path(mode).is_dir()


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _checker(config: object):
    """need(cond, field, message): raise ConfigError naming the field and its value unless cond."""

    def need(cond: bool, name: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{name}: {msg} (got {getattr(config, name)!r})")

    return need


def parse_layer_split(text: str) -> list[tuple[int, int]]:
    """'0:3,3:6' -> [(0, 3), (3, 6)]: contiguous, non-empty ranges starting at 0."""
    try:
        ranges = [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ConfigError(f"layer_split: expected 'lo:hi,lo:hi,...' (got {text!r})") from None
    expect = 0
    for lo, hi in ranges:
        if lo != expect or hi <= lo:
            raise ConfigError(f"layer_split: ranges must be contiguous and non-empty from 0 (got {text!r})")
        expect = hi
    return ranges


@dataclass(frozen=True)
class EngineConfig:
    """The engine and its pipeline group: batching, the KV pool, the ring's deadlines."""

    model: str
    dtype: str | None = None  # None: the checkpoint's dtype
    # weight-only quantization of the decoder projections (model/quant.py); none is HF-exact
    quantization: str = field(default="none", metadata={"choices": QUANTIZATIONS})
    quantization_group_size: int = 32  # int4's group along the input dim
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step (one microbatch)
    # The step pace (engine/fairness.py): prompts and prompt scoring are chunked so a step is predicted
    # to take at most this (measured on the stages); decodes always run. 0: the token budget alone.
    step_target_ms: float = field(
        default=250.0,
        metadata={
            "help": "chunk prompts and prompt scoring so one step is predicted to take at most this many "
            "ms (decodes always run): a long prompt never holds the batch; 0: the token budget alone",
        },
    )
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # explicit pool size (tests); wins over kv_cache_gb
    kv_cache_gb: float | None = None  # None: sized by the engine's limits, capped by memory (kv_cache.py)
    # the default pool's cap: this fraction of the memory available at start-up (CPU: MemAvailable;
    # CUDA: free device memory after the weights are loaded), divided among a local group's stages
    kv_cache_memory_fraction: float = 0.25
    # KV pool dtype; auto: the model's (float32 is HF-exact), float16 for a quantized float32 model.
    # 16-bit halves a float32 pool; greedy outputs then drift from float32's: docs/memory.md
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # --- pipeline group ---
    stages: int = 1
    layer_split: str | None = None  # '0:3,3:6'; None: balanced by layer count
    max_inflight: int | None = None  # microbatches in the ring; None: one per stage
    ring_timeout_s: float = 60.0  # deadline of every wait on a ring link
    heartbeat_s: float = 1.0  # an idle stage 0 sends a heartbeat round the ring this often
    connect_timeout_s: float = 300.0  # deadline for the group to form (all stages loaded and joined)
    log_dir: str | None = None  # local launcher: stage k logs to log_dir/stage-k.log
    # --- HiCache (DESIGN.md section 5) ---
    # L3, shared by every group of the model: redis://[:password@]host:port/db, rediss://, unix://path;
    # 'local': a private redis-server on loopback, started by the launcher (pipeserve up's default when
    # redis-server is installed); 'off' (or unset): no L3.
    hicache_url: str | None = field(default=None, metadata={"env": "PIPESERVE_HICACHE_URL"})
    # L2, host memory per stage: GiB; None: host_cache_memory_fraction of available RAM, split among the
    # group's stages (they share one machine under pipeserve up); 0: no L2.
    host_cache_gb: float | None = None
    host_cache_memory_fraction: float = 0.1
    # Deadline of an L3 load on each stage: base + per_block x blocks, capped at max. The default
    # per block allows ~30 MB/s for the pages of a 135M-parameter float32 model on one stage (737 KB):
    # a loaded 2-core machine; a GPU node with a near Redis can afford far less.
    hicache_load_base_ms: float = 250.0
    hicache_load_per_block_ms: float = 25.0
    hicache_load_max_ms: float = 30_000.0
    hicache_timeout_s: float = 1.0  # socket deadline of every Redis call
    hicache_ttl_s: int | None = None  # expiry of stored pages; None: kept until Redis evicts them
    # Which full blocks go to L3: second-hit stores a block when it is seen again (its chain hash
    # committed before, or found in L1/L2: a shared prefix), so prompts seen once cost Redis nothing;
    # always stores every block on its first computation (write-through).
    hicache_write_policy: str = field(default="second-hit", metadata={"choices": HICACHE_WRITE_POLICIES})
    # Each stage's L3 writes, MB/s (stage 0 paces the stores it orders to it, each writer holds to
    # it): Redis's CPU and bandwidth are taken from serving only this fast. 0: no cap.
    hicache_write_mb_s: float = 64.0
    # Each stage's staging buffer for pages waiting to be written (MiB); a page that finds it full is
    # dropped (counted): the memory L3 writes can take, whatever the traffic.
    hicache_write_buffer_mb: float = 32.0
    # The private redis-server of 'local' (pipeserve up, LLM): its maxmemory in MiB, allkeys-lru beyond
    # (evicted pages are only misses). 0: no limit.
    hicache_local_maxmemory_mb: int = 1024
    # --- flight recorder (obs/flight.py, docs/observability.md) ---
    flight_records: int = 1024  # plans each stage keeps for a dump (0: no recorder)
    flight_max_mib: float = 64.0  # ... and at most this much memory for them; the oldest go first
    # where dumps are written; None: $PIPESERVE_HOME/flight (~/.cache/pipeserve/flight)
    flight_dir: str | None = field(default=None, metadata={"env": "PIPESERVE_FLIGHT_DIR"})

    @property
    def l3_url(self) -> str | None:
        """The Redis URL stages connect to; None without L3 ('local' must be resolved by the launcher)."""
        return None if self.hicache_url in (None, "", "off") else self.hicache_url

    def __post_init__(self) -> None:
        need = _checker(self)
        need(Path(self.model).is_dir(), "model", "must be a checkpoint directory")
        need(self.device.split(":")[0] in DEVICES, "device", f"must be one of {DEVICES}")
        need(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            "must be a power of 2 <= 128",
        )
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        need(self.step_target_ms >= 0, "step_target_ms", "must be >= 0 (0: no step pace)")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        need(self.kv_cache_gb is None or self.kv_cache_gb > 0, "kv_cache_gb", "must be > 0")
        need(
            0 < self.kv_cache_memory_fraction <= 0.9,
            "kv_cache_memory_fraction",
            "must be in (0, 0.9]",
        )
        need(self.quantization in QUANTIZATIONS, "quantization", f"must be one of {', '.join(QUANTIZATIONS)}")
        need(  # CPU: torch's int8/int4 kernels; CUDA: the Triton ones (pipeserve_kernels/triton_quant.py)
            self.quantization == "none" or self.device.split(":")[0] == "cpu" or _triton_installed(),
            "quantization",
            "int8, int4 and gguf on a CUDA device run on Triton kernels and triton is not installed: "
            "install triton or use --quantization none",
        )
        need(
            self.quantization_group_size in (32, 64, 128, 256),
            "quantization_group_size",
            "must be one of 32, 64, 128, 256",
        )
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        need(self.stages >= 1, "stages", "must be >= 1")
        if self.layer_split is not None:
            ranges = parse_layer_split(self.layer_split)
            need(len(ranges) == self.stages, "layer_split", f"needs {self.stages} ranges")
        need(self.max_inflight is None or self.max_inflight >= 1, "max_inflight", "must be >= 1")
        need(self.ring_timeout_s > 0, "ring_timeout_s", "must be > 0")
        need(
            0 < self.heartbeat_s < self.ring_timeout_s / 2,
            "heartbeat_s",
            "must be > 0 and under half of ring_timeout_s",
        )
        need(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
        need(
            self.hicache_url in (None, "", "off", "local")
            or self.hicache_url.startswith(("redis://", "rediss://", "unix://")),
            "hicache_url",
            "must be redis://, rediss://, unix://, 'local' or 'off'",
        )
        need(self.host_cache_gb is None or self.host_cache_gb >= 0, "host_cache_gb", "must be >= 0")
        need(
            0 < self.host_cache_memory_fraction <= 0.9,
            "host_cache_memory_fraction",
            "must be in (0, 0.9]",
        )
        need(self.hicache_load_base_ms >= 0, "hicache_load_base_ms", "must be >= 0")
        need(self.hicache_load_per_block_ms >= 0, "hicache_load_per_block_ms", "must be >= 0")
        need(
            self.hicache_load_max_ms >= max(1.0, self.hicache_load_base_ms),
            "hicache_load_max_ms",
            "must be >= hicache_load_base_ms and >= 1",
        )
        need(self.hicache_timeout_s > 0, "hicache_timeout_s", "must be > 0")
        need(self.hicache_ttl_s is None or self.hicache_ttl_s >= 1, "hicache_ttl_s", "must be >= 1")
        need(
            self.hicache_write_policy in HICACHE_WRITE_POLICIES,
            "hicache_write_policy",
            f"must be one of {', '.join(HICACHE_WRITE_POLICIES)}",
        )
        need(self.hicache_write_mb_s >= 0, "hicache_write_mb_s", "must be >= 0 (0: no cap)")
        need(self.hicache_write_buffer_mb > 0, "hicache_write_buffer_mb", "must be > 0")
        need(self.hicache_local_maxmemory_mb >= 0, "hicache_local_maxmemory_mb", "must be >= 0 (0: no limit)")
        need(self.flight_records >= 0, "flight_records", "must be >= 0")
        need(self.flight_max_mib >= 0.01, "flight_max_mib", "must be >= 0.01")
        need(self.flight_dir is None or bool(self.flight_dir), "flight_dir", "must not be empty")

    def split_ranges(self) -> list[tuple[int, int]] | None:
        return None if self.layer_split is None else parse_layer_split(self.layer_split)

    @property
    def inflight(self) -> int:
        return self.max_inflight if self.max_inflight is not None else self.stages

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


# --- command-line form -------------------------------------------------------
# Fields a stage process takes from its launcher, not from its own flags.
_NOT_FLAGS = {"model", "stages", "log_dir"}


def _flag_type(cls: type, name: str) -> type:
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_config_args(
    parser: argparse.ArgumentParser, cls: type, skip: set[str] = _NOT_FLAGS, prefix: str = ""
) -> None:
    """One flag per dataclass field (`--max-num-seqs`; `--{prefix}-...` with a prefix), defaulting
    to the field's default. A field's metadata may add `choices`, `help` and
    an environment variable that replaces the default when set and non-empty (`env`). The flags
    form one group of the help, titled by the class and described by its docstring."""
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").split("\n\n")[0].strip())
    for f in fields(cls):
        if f.name in skip:
            continue
        dest = prefix + f.name
        names = ["--" + dest.replace("_", "-")]
        kind = _flag_type(cls, f.name)
        default = None if f.default is MISSING else f.default
        if (env := f.metadata.get("env")) and os.environ.get(env):
            default = os.environ[env]  # a string: argparse converts it with `type`
        if kind is bool:
            group.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=default)
        else:
            choices = f.metadata.get("choices")
            help_text = f.metadata.get("help")
            group.add_argument(*names, dest=dest, type=kind, default=default, choices=choices, help=help_text)


def config_from_args(
    cls: type[T], args: argparse.Namespace, skip: set[str] = _NOT_FLAGS, prefix: str = "", **fixed
) -> T:
    values = {f.name: getattr(args, prefix + f.name) for f in fields(cls) if f.name not in skip}  # type: ignore[arg-type]
    return cls(**values, **fixed)


def config_argv(config: object, skip: set[str] = _NOT_FLAGS) -> list[str]:
    """The flags that reproduce `config` through add_config_args (defaults omitted)."""
    argv: list[str] = []
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if f.name in skip or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


# --- serving -----------------------------------------------------------------
POLICIES = ("round_robin", "least_load", "prefix_affinity")
# --tool-call-parser's names (vLLM's); router/tool_parsers' registry holds the same (a test checks)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# --reasoning-parser's names (vLLM's); router/reasoning.py's registry holds the same (a test checks)
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class StageServeConfig:
    """How a stage process serves: its side port, stage 0's gRPC port, wedge detection, draining."""

    host: str = "127.0.0.1"  # where the side port and stage 0's gRPC server listen
    health_port: int = 0  # /livez /readyz /metrics; 0: no side port
    grpc_port: int = 0  # stage 0 only; 0: no gRPC server (the stage idles, as before issue 4)
    wedge_timeout_s: float = 60.0  # work pending and no progress this long ⇒ WEDGE
    wedge_grace_s: float = 5.0  # after the WEDGE report, exit non-zero after this long
    max_waiting: int = 1024  # stage 0's admission bound: queued requests beyond it get RESOURCE_EXHAUSTED
    # SIGTERM: finish in-flight requests for at most this long
    drain_timeout_s: float = 30.0
    served_model_name: str = ""

    def __post_init__(self) -> None:
        need = _checker(self)
        need(0 <= self.health_port < 65536, "health_port", "must be a port number (0: none)")
        need(0 <= self.grpc_port < 65536, "grpc_port", "must be a port number (0: none)")
        need(self.wedge_timeout_s > 0, "wedge_timeout_s", "must be > 0")
        need(self.wedge_grace_s >= 0, "wedge_grace_s", "must be >= 0")
        need(self.max_waiting >= 1, "max_waiting", "must be >= 1")
        need(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")


@dataclass(frozen=True)
class RouterConfig:
    """The router: its HTTP API, how it picks a group, and the deadline of every upstream call."""

    model: str  # checkpoint directory: tokenizer.json, tokenizer_config.json (chat template)
    served_model_name: str = ""  # the `model` clients send; "" means `model` as given
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = field(default="round_robin", metadata={"choices": POLICIES})
    # Bearer token for /v1/*, /groups, /openapi.json; None: open
    api_key: str | None = field(default=None, metadata={"env": "PIPESERVE_API_KEY"})
    max_concurrency: int = 256  # requests in flight at the router; more get 429
    health_interval_s: float = 0.5  # how often every group's Health and Load are polled
    rpc_timeout_s: float = 2.0  # deadline of Health, Load and Abort calls
    first_token_timeout_s: float = 120.0  # Generate: deadline for the first message
    stream_idle_timeout_s: float = 60.0  # Generate: deadline for each later message
    health_generate_recent_s: float = 5.0  # /health_generate: tokens this recent mean healthy
    probe_timeout_s: float = 30.0  # /health_generate: deadline of the 1-token probe
    # prefix_affinity: leave the affine group when its load exceeds the least loaded's by more than this
    affinity_overload: int = 8
    # The chat template: a file path or the template text (vLLM's --chat-template); None: the checkpoint's
    # (chat_template.jinja, else tokenizer_config.json's chat_template).
    chat_template: str | None = None
    # How the model writes tool calls (router/tool_parsers): needed by tool_choice "auto"; None: no parser
    tool_call_parser: str | None = field(default=None, metadata={"choices": TOOL_CALL_PARSERS})
    # How the model marks its reasoning (router/reasoning.py): chat responses carry the text between
    # <think> and </think> as `reasoning_content`, apart from `content`; None: all of it is content
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "choices": REASONING_PARSERS,
            "help": "split <think>...</think> into the chat message's reasoning_content (vLLM's names)",
        },
    )
    # The defaults of sampling fields a request leaves unset (request_defaults.py): vLLM's flag and values
    generation_config: str = field(
        default="auto",
        metadata={
            "help": f"defaults of the request fields {', '.join(MODEL_DEFAULTED)} from: auto, the model's "
            "generation_config.json (a GGUF file's sampling metadata); vllm, none from the model; or "
            "DIR/generation_config.json. A request's own values win",
        },
    )
    tokenizer_threads: int = 2  # the router's pool for tokenization and chat rendering (off the event loop)
    # Slow or hostile clients (router/http_guard.py): a connection's request line and headers must arrive
    # within header_timeout_s of its start (or of its previous response) and fit in max_header_bytes;
    # a body must arrive whole within body_timeout_s of its headers. Otherwise 408 / 431, closed.
    header_timeout_s: float = 10.0
    max_header_bytes: int = 65536
    body_timeout_s: float = 30.0
    # What one request may cost (router/cost.py): above either limit, a 400 naming the client's field.
    max_prompt_scoring: int = field(
        default=131072,
        metadata={
            "help": "prompt tokens x prompt_logprobs (echo's logprobs; at least 1) one request may have "
            "scored, summed over its prompts; more is a 400 naming the field",
        },
    )
    max_generated_tokens: int = field(
        default=524288,
        metadata={
            "help": "prompts x best_of (n) x max_tokens one request may generate; more is a 400 naming "
            "n, best_of or max_tokens",
        },
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def __post_init__(self) -> None:
        need = _checker(self)
        need(Path(self.model).is_dir(), "model", "must be a checkpoint directory")
        need(0 <= self.port < 65536, "port", "must be a port number")
        need(self.policy in POLICIES, "policy", f"must be one of {POLICIES}")
        need(self.api_key is None or bool(self.api_key), "api_key", "must not be empty")
        need(self.max_concurrency >= 1, "max_concurrency", "must be >= 1")
        for name in (
            "health_interval_s",
            "rpc_timeout_s",
            "first_token_timeout_s",
            "stream_idle_timeout_s",
            "health_generate_recent_s",
            "probe_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
        ):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.affinity_overload >= 0, "affinity_overload", "must be >= 0")
        need(self.chat_template is None or bool(self.chat_template), "chat_template", "must not be empty")
        need(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            "tool_call_parser",
            f"must be one of {TOOL_CALL_PARSERS}",
        )
        need(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            "reasoning_parser",
            f"must be one of {REASONING_PARSERS}",
        )
        need(generation_config_ok(self.generation_config), "generation_config", GENERATION_CONFIG_RULE)
        need(1 <= self.tokenizer_threads <= 64, "tokenizer_threads", "must be in [1, 64]")
        need(1024 <= self.max_header_bytes <= 2**24, "max_header_bytes", "must be in [1024, 16 MiB]")
        need(self.max_prompt_scoring >= 1, "max_prompt_scoring", "must be >= 1")
        need(self.max_generated_tokens >= 1, "max_generated_tokens", "must be >= 1")


@dataclass(frozen=True)
class ModelEntry:
    """One model of `pipeserve router --models FILE` (router/models_file.py reads the file): the name
    clients send, its tokenizer, and where its groups come from: an InferencePipeline (`pipeline`, with
    --discover kubernetes) or host:port list (`upstream`, static). `policy` None: --policy if given,
    else the InferencePipeline's spec.router.policy, else round_robin."""

    model: str  # the served name: a request's `model`, an entry of /v1/models
    tokenizer: str  # directory with the tokenizer files
    pipeline: str = ""  # kubernetes: the InferencePipeline's name
    upstream: str | None = None  # static: host:port[,host:port...]
    chat_template: str | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        need = _checker(self)
        need(bool(self.model) and self.model == self.model.strip(), "model", "must be a non-empty name")
        need(Path(self.tokenizer).is_dir(), "tokenizer", "must be a directory with the tokenizer files")
        need(
            not self.pipeline or bool(re.fullmatch(_K8S_NAME, self.pipeline)),
            "pipeline",
            "must be an InferencePipeline name",
        )
        need(self.chat_template is None or bool(self.chat_template), "chat_template", "must not be empty")
        need(self.policy is None or self.policy in POLICIES, "policy", f"must be one of {POLICIES}")


DISCOVERY_KINDS = ("static", "kubernetes")
_K8S_NAME = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # RFC 1123 label: a namespace or an object name


@dataclass(frozen=True)
class DiscoveryConfig:
    """How `pipeserve router` finds its groups: a fixed --upstream list, or an InferencePipeline's status."""

    kind: str = "static"
    upstream: str | None = None  # static: host:port[,host:port...]
    namespace: str = "default"  # kubernetes: the InferencePipeline's namespace
    pipeline: str = ""  # kubernetes: its name
    # kubernetes: an API server URL used without auth (tests, dev); None: in-cluster, else kubeconfig
    kube_api: str | None = None
    watch_timeout_s: float = 60.0  # one watch call's server-side timeout; the client reads at most +request
    request_timeout_s: float = 10.0  # deadline of a list call, and the margin on a watch's
    backoff_s: float = 0.5  # after a failed list/watch; doubles per failure in a row
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        need = _checker(self)
        need(self.kind in DISCOVERY_KINDS, "kind", f"must be one of {DISCOVERY_KINDS}")
        for name in ("watch_timeout_s", "request_timeout_s", "backoff_s", "backoff_max_s"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.backoff_max_s >= self.backoff_s, "backoff_max_s", "must be >= backoff_s")
        if self.kind == "static":
            need(bool(self.upstream), "upstream", "need at least one host:port (--upstream)")
            return
        need(not self.upstream, "upstream", "is for --discover static only")
        need(bool(re.fullmatch(_K8S_NAME, self.namespace)), "namespace", "must be a Kubernetes name")
        need(bool(re.fullmatch(_K8S_NAME, self.pipeline)), "pipeline", "must be an InferencePipeline name")
        need(
            self.kube_api is None or self.kube_api.startswith(("http://", "https://")),
            "kube_api",
            "must be an http(s):// URL",
        )


@dataclass(frozen=True)
class SupervisorConfig:
    """How `pipeserve up`'s supervisor watches its groups (the operator will read the same fields)."""

    interval_s: float = 0.5  # every group is looked at this often
    probe_timeout_s: float = 1.0  # deadline of one /livez or /readyz call
    backoff_s: float = 1.0  # delay before the first restart; doubles per failure in a row
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # a group ready this long is forgiven its past failures
    kill_grace_s: float = 3.0  # SIGTERM, then SIGKILL after this
    start_grace_s: float = 30.0  # a new incarnation's side ports may not answer yet for this long
    ready_margin_s: float = 30.0  # not ready connect_timeout_s + this after its start: restart
    # /livez silent for longer than the stage's own detector needs (wedge timeout + grace) + this:
    # a stage frozen too hard to exit by itself (SIGSTOP)
    unanswered_margin_s: float = 5.0

    def __post_init__(self) -> None:
        need = _checker(self)
        for f in fields(self):
            need(getattr(self, f.name) > 0, f.name, "must be > 0")
        need(self.backoff_max_s >= self.backoff_s, "backoff_max_s", "must be >= backoff_s")
