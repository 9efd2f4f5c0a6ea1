"""The daemon's configuration: its schema (typed msgspec structs decoded from TOML), the rules
between its fields, and where its file is found and read.

Unknown keys, wrong types and bad values are errors that name the key and the file, raised
before anything starts. This package's surface is what its three modules offer users of a
configuration (``from servectl import config as C``); its modules import one another, never it.
"""

from servectl.config import cluster
from servectl.config.lookup import (CONFIG_ENV, SYSTEM_CONFIG, config_candidates, effective_config, find_config_file,
                                    is_system_daemon, load_config, user_config_path)
from servectl.config.rules import (api_key_problem, apply_overrides, check_lora_names, explain, finalize, lora_enabled,
                                   lora_modules, memory_budget, replica_devices)
from servectl.config.schema import (DEFAULT_ENGINE_ARGS, DEFAULT_FREEZE_GRACE_S, DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME,
                                    ENGINE_OFFLINE_ENV, FRONTEND_KEYS, LORA_NAME_PATTERN, NAME_PATTERN, REDACTED,
                                    BatchConfig, ClusterConfig, Config, ConfigError, GatewayConfig, GenerationKey, IdlePolicy,
                                    IdleRelease,
                                    LoraModule, ManagerConfig, ModelConfig, NamedKey, NonNegativeFloat, Overrides,
                                    PositiveFloat, PositiveInt, SleepLevel, decode, default_model, encode,
                                    output_identity, redacted)

__all__ = [
    # schema
    "DEFAULT_ENGINE_ARGS", "DEFAULT_FREEZE_GRACE_S", "DEFAULT_MODEL_DIR", "DEFAULT_MODEL_NAME", "ENGINE_OFFLINE_ENV",
    "FRONTEND_KEYS", "LORA_NAME_PATTERN", "NAME_PATTERN", "REDACTED", "BatchConfig", "ClusterConfig", "Config", "ConfigError", "GatewayConfig",
    "GenerationKey", "IdlePolicy", "IdleRelease", "LoraModule", "ManagerConfig", "ModelConfig", "NamedKey", "NonNegativeFloat",
    "Overrides", "PositiveFloat", "PositiveInt", "SleepLevel", "decode", "default_model", "encode",
    "output_identity", "redacted",
    # rules
    "api_key_problem", "apply_overrides", "check_lora_names", "explain", "finalize", "lora_enabled", "lora_modules",
    "memory_budget", "replica_devices",
    # cluster (a model spread over hosts)
    "cluster",
    # lookup
    "CONFIG_ENV", "SYSTEM_CONFIG", "config_candidates", "effective_config", "find_config_file", "is_system_daemon",
    "load_config", "user_config_path",
]
