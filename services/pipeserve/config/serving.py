"""StageServeConfig (how a stage process serves) and RouterConfig (the router's HTTP API).

Each field is declared once with its help, unit, range and group (fields.py: `opt`); the flags of
`pipeserve stage`, `pipeserve up` and `pipeserve router` come from them (flags.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeserve import env as pipeserve_env
from pipeserve.config.fields import REQUIRED, check_ranges, checker, opt
from pipeserve.sampling_fields import SAMPLING_FIELDS

POLICIES = ("round_robin", "least_load", "prefix_affinity")
# --tool-call-parser's names (vLLM's); router/features/tool_parsers' registry holds the same (a test checks)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# --reasoning-parser's names (vLLM's); router/features/reasoning.py's registry holds the same (a test checks)
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# Where requests' default sampling values come from (request_defaults.py), vLLM's --generation-config:
# auto: the model's generation_config.json; vllm: none from the model; or a directory holding one.
GENERATION_CONFIG_MODES = ("auto", "vllm")
MODEL_DEFAULTED = tuple(f.name for f in SAMPLING_FIELDS if f.model_default)  # the fields it sets
GENERATION_CONFIG_RULE = (
    f"must be {' or '.join(GENERATION_CONFIG_MODES)} or a directory holding generation_config.json"
)


def generation_config_ok(mode: str) -> bool:
    return mode in GENERATION_CONFIG_MODES or Path(mode).is_dir()


@dataclass(frozen=True)
class StageServeConfig:
    """How a stage process serves: its side port, stage 0's gRPC port, wedge detection, draining."""

    host: str = opt("127.0.0.1", "where the side port and stage 0's gRPC server listen", group="serving")
    health_port: int = opt(
        0, "/livez /readyz /metrics; 0: no side port", group="serving", range="in [0, 65535]"
    )
    grpc_port: int = opt(
        0, "stage 0's gRPC server; 0: none (the stage idles)", group="serving", range="in [0, 65535]"
    )
    wedge_timeout_s: float = opt(
        60.0,
        "work pending and no progress this long: the stage reports WEDGE",
        group="supervision",
        unit="s",
        range="> 0",
    )
    wedge_grace_s: float = opt(
        5.0,
        "after the WEDGE report, exit non-zero after this long",
        group="supervision",
        unit="s",
        range=">= 0",
        internal=True,
    )
    max_waiting: int = opt(
        1024,
        "stage 0's admission bound: queued requests beyond it are refused (429)",
        group="serving",
        range=">= 1",
    )
    drain_timeout_s: float = opt(
        30.0,
        "SIGTERM: finish in-flight requests for at most this long",
        group="serving",
        unit="s",
        range=">= 0",
        chart="router.drainSeconds",
    )
    served_model_name: str = opt(
        "",
        "the model name clients send and /v1/models lists",
        group="model",
        shown="the --model as given",
    )

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(frozen=True)
class RouterConfig:
    """The router: its HTTP API, how it picks a group, and the deadline of every upstream call."""

    model: str = opt(
        REQUIRED,
        "directory with the tokenizer files: tokenizer.json, tokenizer_config.json (chat template)",
        group="model",
        env=pipeserve_env.MODEL,
        chart="router.tokenizer.path",
    )
    served_model_name: str = opt(
        "",
        "the model name clients send and /v1/models lists",
        group="model",
        shown="the --model as given",
        chart="router.servedModelName",
    )
    host: str = opt("127.0.0.1", "the router's listening address", group="router")
    port: int = opt(8000, "the router's HTTP port", group="router", range="in [0, 65535]")
    policy: str = opt("round_robin", "how a group is picked", group="router", choices=POLICIES)
    api_key: str | None = opt(
        None,
        "bearer token for /v1/*, /groups, /openapi.json",
        group="router",
        env=pipeserve_env.API_KEY,
        shown="none: open",
        chart="router.apiKey.existingSecret",
    )
    max_concurrency: int = opt(
        256, "requests in flight at the router; more get 429", group="router", range=">= 1"
    )
    health_interval_s: float = opt(
        0.5, "how often every group's Health and Load are polled", group="router", unit="s", range="> 0"
    )
    rpc_timeout_s: float = opt(
        2.0, "deadline of Health, Load and Abort calls", group="router", unit="s", range="> 0"
    )
    first_token_timeout_s: float = opt(
        120.0, "Generate: deadline for the first message", group="router", unit="s", range="> 0"
    )
    stream_idle_timeout_s: float = opt(
        60.0, "Generate: deadline for each later message", group="router", unit="s", range="> 0"
    )
    health_generate_recent_s: float = opt(
        5.0, "/health_generate: tokens this recent mean healthy", group="router", unit="s", range="> 0"
    )
    probe_timeout_s: float = opt(
        30.0, "/health_generate: deadline of the 1-token probe", group="router", unit="s", range="> 0"
    )
    affinity_overload: int = opt(
        8,
        "prefix_affinity: leave the affine group when its load exceeds the least loaded's by more",
        group="router",
        unit="requests",
        range=">= 0",
    )
    chat_template: str | None = opt(
        None,
        "the chat template: a file path or the template text (vLLM's --chat-template)",
        group="model",
        shown="the checkpoint's (chat_template.jinja, else tokenizer_config.json's)",
    )
    tool_call_parser: str | None = opt(
        None,
        "how the model writes tool calls, needed by tool_choice auto",
        group="model",
        choices=TOOL_CALL_PARSERS,
        shown="none: no parser",
        chart="router.toolCallParser",
    )
    reasoning_parser: str | None = opt(
        None,
        "split <think>...</think> into the chat message's reasoning_content (vLLM's names)",
        group="model",
        choices=REASONING_PARSERS,
        shown="none: all of it is content",
    )
    generation_config: str = opt(
        "auto",
        f"defaults of the request fields {', '.join(MODEL_DEFAULTED)} from: auto, the model's "
        "generation_config.json (a GGUF file's sampling metadata); vllm, none from the model; or "
        "DIR/generation_config.json. A request's own values win",
        group="model",
    )
    tokenizer_threads: int = opt(
        2, "the router's pool for tokenization and chat rendering", group="router", range="in [1, 64]"
    )
    # Slow or hostile clients (router/http/http_guard.py): otherwise 408 / 431, closed.
    header_timeout_s: float = opt(
        10.0,
        "a connection's request line and headers must arrive within this of its start or last response",
        group="router",
        unit="s",
        range="> 0",
    )
    max_header_bytes: int = opt(
        65536,
        "a request's line and headers must fit in this",
        group="router",
        unit="bytes",
        range="in [1024, 16777216]",
    )
    body_timeout_s: float = opt(
        30.0, "a body must arrive whole within this of its headers", group="router", unit="s", range="> 0"
    )
    # What one request may cost (router/features/cost.py): above either limit, a 400 naming the
    # client's field.
    max_prompt_scoring: int = opt(
        131072,
        "prompt tokens x prompt_logprobs (echo's logprobs; at least 1) one request may have scored, summed "
        "over its prompts",
        group="router",
        unit="tokens",
        range=">= 1",
    )
    max_generated_tokens: int = opt(
        524288,
        "prompts x best_of (n) x max_tokens one request may generate",
        group="router",
        unit="tokens",
        range=">= 1",
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def __post_init__(self) -> None:
        need = checker(self)
        need(Path(self.model).is_dir(), "model", "must be a checkpoint directory")
        check_ranges(self)
        need(self.policy in POLICIES, "policy", f"must be one of {POLICIES}")
        need(self.api_key is None or bool(self.api_key), "api_key", "must not be empty")
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
