"""The typed configs: every setting of pipeserve, each declared once (fields.py: `opt`) with its type,
default, unit, range, group and one-line help, from which come its flag (flags.py), its check, its
environment variable (pipeserve/env.py) and its line in docs/configuration.md.

Invalid values raise ConfigError (a ValueError) naming the field. A launcher turns a config back
into the argv of a stage process with `config_argv`, so nothing is listed twice.
"""

from pipeserve.config.discovery import DISCOVERY_KINDS, DiscoveryConfig, ModelEntry, SupervisorConfig
from pipeserve.config.engine import (
    DEVICES,
    HICACHE_WRITE_POLICIES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
    parse_layer_split,
)
from pipeserve.config.fields import GROUPS, opt
from pipeserve.config.flags import NOT_FLAGS, add_config_args, config_argv, config_from_args
from pipeserve.config.serving import (
    GENERATION_CONFIG_MODES,
    GENERATION_CONFIG_RULE,
    MODEL_DEFAULTED,
    POLICIES,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    RouterConfig,
    StageServeConfig,
    generation_config_ok,
)

# Every config whose fields are settings, in the order the docs list them.
# A flag two configs share (--host, --served-model-name) is described by the first: `up`'s view.
CONFIGS = (EngineConfig, RouterConfig, StageServeConfig, SupervisorConfig, DiscoveryConfig, ModelEntry)

__all__ = [
    "CONFIGS",
    "DEVICES",
    "DISCOVERY_KINDS",
    "GENERATION_CONFIG_MODES",
    "GENERATION_CONFIG_RULE",
    "GROUPS",
    "HICACHE_WRITE_POLICIES",
    "KV_CACHE_DTYPES",
    "MODEL_DEFAULTED",
    "NOT_FLAGS",
    "POLICIES",
    "QUANTIZATIONS",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "DiscoveryConfig",
    "EngineConfig",
    "ModelEntry",
    "RouterConfig",
    "StageServeConfig",
    "SupervisorConfig",
    "add_config_args",
    "config_argv",
    "config_from_args",
    "generation_config_ok",
    "opt",
    "parse_layer_split",
]
