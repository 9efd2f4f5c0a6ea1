"""The configuration's schema: typed msgspec structs decoded from TOML, their defaults, and
the views made of them (redacted for display, JSON for the manager's memfd, output identity).

Unknown keys, wrong types and bad values are refused at decode; the rules between fields are
servectl/config/rules.py's, finding and reading the file servectl/config/lookup.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from servectl.wire.vocab import MODEL_NAME, IdleMode

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "model" / "default"
DEFAULT_MODEL_NAME = "default"
# A model's name (MODEL_NAME: also part of file and socket names, servectl/paths.py).
# \Z, not $: "$" also matches before a final newline, so "ok\n" would pass.
NAME_PATTERN = rf"^{MODEL_NAME}\Z"

# An idle engine freezes its workers after this long (also what `servectl
# freeze MODEL on` uses when the config turned freezing off with 0).
DEFAULT_FREEZE_GRACE_S = 2.0

# What vLLM reads from a generation config (ModelConfig.get_diff_sampling_param); max_new_tokens
# caps every request's max_tokens.
GenerationKey = Literal["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                        "frequency_penalty", "max_new_tokens"]

# Engines and workers never reach the hub unless a model's `env` says otherwise
# (manager/group.py puts these in their environment): a hub id must then be in
# the local Hugging Face cache (servectl/model_check.py checks it there).
ENGINE_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
# How an idle model gives its memory back (see ManagerConfig.idle_release).
IdleRelease = IdleMode
SleepLevel = Literal[1, 2]


# A named key's name: in logs, metrics labels and the usage file (never the key itself).
KEY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z"


class NamedKey(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A ``[[gateway.keys]]`` entry: a team's API key, its name, its limits across every
    gateway process (docs/tenancy.md), its share of a saturated model and the models it may use."""

    name: Annotated[str, msgspec.Meta(pattern=KEY_NAME_PATTERN)]
    key: str | None = None
    key_file: str | None = None  # its first word is the key (the file is read at start and reload)
    max_concurrent_requests: PositiveInt | None = None
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None  # prompt + completion tokens of requests finished in 60 s
    weight: PositiveFloat = 1.0  # its share of a saturated model against other keys'
    models: list[str] | None = None  # None: every model; a LoRA adapter is allowed by its own name or its model's

    @property
    def limited(self) -> bool:
        return bool(self.max_concurrent_requests or self.requests_per_minute or self.tokens_per_minute)


class BatchConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[gateway.batch]``: the OpenAI Files and Batch APIs (docs/batch.md), their bounds."""

    # How many of a batch's lines are in flight at once (each at the lowest priority: they fill
    # what interactive requests leave, and a better priority takes their slot).
    concurrency: PositiveInt = 16
    max_file_bytes: PositiveInt = 200 * 1024 * 1024  # one uploaded file (OpenAI's limit)
    max_lines: PositiveInt = 50_000  # one batch's input lines (OpenAI's limit)
    max_in_progress_per_key: PositiveInt = 16  # batches not yet ended, per key
    max_stored_bytes: PositiveInt = 10 * 1024 ** 3  # every stored file together (inputs and outputs)
    # Files (inputs, outputs, error files) are deleted this long after they were made; a batch's
    # record, this long after it ended. 0: kept until deleted.
    expire_after_s: NonNegativeFloat = 30 * 24 * 3600.0


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    processes: PositiveInt = 1
    # Requests that arrive while their engine restarts wait this long.
    hold_timeout_s: PositiveFloat = 60.0
    # A stream with nothing to send this long (held while its model loads, queued, in prefill)
    # gets an SSE comment, ": keep-alive", so proxies do not cut it (vLLM's --sse-keep-alive-interval;
    # 0: never). vLLM's default is 0; a held load takes minutes, so servectl's is not.
    sse_keep_alive_interval: NonNegativeFloat = 15.0
    # No output for an in-flight request this long, and then no answer from its
    # engine for as long again (a step stuck on a hung worker): the group is hung.
    output_timeout_s: PositiveFloat = 120.0
    # A request body's bytes, media included (413 past it); media lifts the default from 4 MiB.
    max_body_bytes: PositiveInt = 32 * 1024 * 1024
    # What one request's media parts carry inline (base64, decoded): 413 past it. URLs are
    # fetched by the engine under vLLM's VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB (engine_core/media.py).
    max_media_bytes: PositiveInt = 20 * 1024 * 1024
    # Sequences (prompts × n) waiting per model and gateway beyond what the engine runs at once.
    max_waiting_per_model: PositiveInt = 256
    # One request's prompts × n: more is a 400 (one request may fill a batch, not a queue).
    max_sequences_per_request: PositiveInt = 256
    # Items of one /v1/responses input or /v1/messages request (and never more than the model's
    # context length): more is a 400 before the engine renders any (api_gateway/input_bounds.py).
    max_input_items: PositiveInt = 4096
    # A connection has this long to send a request's headers (from its opening or the end of
    # its previous response: also how long an idle keep-alive connection stays open).
    header_timeout_s: PositiveFloat = 60.0
    # A request's body must arrive within this long of its headers; a streamed response whose
    # client reads nothing for this long is cut.
    body_timeout_s: PositiveFloat = 60.0
    # Open connections per gateway process; 0: its descriptor limit (raised to the hard limit
    # at start) less a reserve for its own sockets. Past it the oldest idle connection is
    # closed; with none idle, a new one gets a 503 and is closed (api_gateway/http_server.py).
    max_connections: Annotated[int, msgspec.Meta(ge=0)] = 0
    api_keys: list[str] = []
    api_key_file: str | None = None
    # Keys for the model-management routes (/servectl/v1/...); also accepted wherever an API
    # key is. None configured: those routes do not exist (404).
    admin_keys: list[str] = []
    admin_key_file: str | None = None
    # Named API keys ([[gateway.keys]]): usage counted per name, limits, a weight, allowed models.
    keys: list[NamedKey] = []
    # Keys share a saturated model by weight (vLLM's priority scheduling: each request's priority
    # is its key's fair-share tag; an engine started with scheduling_policy = "fcfs" ignores it).
    fair_share: bool = True
    # Host names answered besides localhost names and loopback IPs. Bound to a
    # loopback address, any other Host gets 421 (no DNS rebinding); bound
    # elsewhere the check applies only when this is set. ["*"]: no check.
    allowed_hosts: list[str] = []
    # Origins whose pages may call the API (CORS); none by default. ["*"]: any.
    cors_origins: list[str] = []
    # Addresses of reverse proxies that terminate TLS in front of the gateway: a request from
    # one with X-Forwarded-Proto: https gets the status page's session cookie marked Secure.
    tls_proxies: list[str] = []
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)


class ManagerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    runtime_dir: str | None = None
    state_dir: str | None = None
    backoff_initial_s: PositiveFloat = 1.0
    backoff_max_s: PositiveFloat = 30.0
    crash_loop_count: PositiveInt = 5
    crash_loop_window_s: PositiveFloat = 120.0
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    stop_grace_s: PositiveFloat = 10.0
    # On a stop, /ready fails this long before new requests are refused: routers and kubelets
    # probing it stop sending here first (set it to their probe period times failure threshold).
    unready_grace_s: NonNegativeFloat = 0.0
    # Engine's wait for a worker reply where a call may legitimately be slow (its first steps,
    # a step larger than any seen, loading); past it the group is hung.
    worker_reply_timeout_s: PositiveFloat = 120.0
    # Once warm, a step's deadline is this multiple of the recent 99th percentile of steps
    # its size, never below the floor (engine_core/workers/step_deadline.py).
    step_deadline_multiple: PositiveFloat = 20.0
    step_deadline_floor_s: PositiveFloat = 5.0
    # An idle engine freezes its workers after this long (0 disables).
    freeze_grace_s: Annotated[float, msgspec.Meta(ge=0)] = DEFAULT_FREEZE_GRACE_S
    # One interpreter per group member that has imported vLLM and waits for a
    # crash restart to hand it the role (costs host memory, no CPU, no GPU).
    warm_standby: bool = True
    # Defaults for every model (each may override them): release a model once
    # no request has been unfinished for this long (0: never), by stopping its
    # engine group ("unload": its warm standbys stay) or with vLLM's sleep mode
    # ("sleep", where the platform has it; elsewhere it falls back to unload).
    idle_release_s: NonNegativeFloat = 0.0
    idle_release: IdleRelease = IdleMode.UNLOAD
    sleep_level: SleepLevel = 1  # vLLM's: 1 offloads weights to host memory, 2 discards them
    # At most this many models loaded at once (None: no cap): a model that must start releases
    # the least recently used one first (manager/budget.py); at start, models beyond it stay
    # released until their first request.
    max_loaded_models: PositiveInt | None = None
    # Memory per device label (a GPU index, or "cpu" for host memory on a machine without one):
    # bytes, a size ("24GiB") or a fraction of the device's memory (0.8). A model that does not
    # fit beside those loaded releases the least recently used ones first (manager/budget.py).
    memory_budget: dict[str, int | float | str] = {}
    # Directories an HTTP caller (an admin key, /v1/load_lora_adapter) may load LoRA adapters from
    # at run time; none by default. `servectl lora load` (the daemon's owner) may name any path.
    lora_roots: list[str] = []
    # Every process's log lines: "text", or "json" (one object per line: time, level, component,
    # model, logger, message, request_id, pid; servectl/logjson.py). Read at start: a reload keeps
    # the running tree's (a log file with two formats in it would be read by neither's tools).
    log_format: Literal["text", "json"] = "text"
    # OpenTelemetry traces of every request and of the manager's restarts, evictions, wakes and
    # rolls go to this OTLP endpoint ("": the OTEL_EXPORTER_OTLP_* environment decides; docs/
    # operations.md). Put in the whole tree's environment at start: a reload keeps the running one.
    otlp_traces_endpoint: str = ""


# A LoRA adapter's name: a model name of its own in requests and /v1/models (vLLM's --lora-modules
# names; never ":" or "/" at the start, no spaces).
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}\Z"


class LoraModule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One LoRA adapter of a model (vLLM's ``--lora-modules`` JSON form): served under ``name``,
    loaded from ``path`` (a directory with adapter_config.json and the adapter's weights)."""

    name: Annotated[str, msgspec.Meta(pattern=LORA_NAME_PATTERN)]
    path: str
    base_model_name: str | None = None  # the parent shown in /v1/models (default: the model's name)


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    model: str
    tensor_parallel_size: PositiveInt = 1
    # Engine groups serving this model, each on its own devices; one name in /v1/models.
    replicas: PositiveInt = 1
    # CUDA_VISIBLE_DEVICES of its workers: one string (split evenly among the replicas), or
    # one string per replica.
    devices: str | list[str] | None = None
    # One table per replica, over `env` for that replica alone: where it runs (CPU binding, a
    # network interface), never what it answers (replicas are interchangeable mid-request).
    replica_env: list[dict[str, str]] = []
    engine_args: dict[str, Any] = {}
    env: dict[str, str] = {}
    # Per-model override of [manager] crash_loop_count (e.g. a flaky model).
    crash_loop_count: PositiveInt | None = None
    # Default sampling parameters over the model's generation_config.json (vLLM's
    # --override-generation-config); a value the client sends still wins.
    override_generation_config: dict[GenerationKey, int | float] = {}
    # Apply a chat template sent with a request (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False
    # vLLM's chat flags (`vllm serve --enable-auto-tool-choice --tool-call-parser NAME ...`), applied
    # where the engine renders and parses a chat (engine_core/chat_parsing.py). vLLM's
    # `reasoning_parser` is an engine argument: it goes in engine_args.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # any name vLLM (or tool_parser_plugin) registers
    tool_parser_plugin: str | None = None  # a Python file registering more tool-call parsers
    tool_strict_level: Literal["auto", "function", "parameter"] = "auto"
    chat_template: str | None = None  # a file, or the template itself (vLLM's --chat-template)
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    default_chat_template_kwargs: dict[str, Any] = {}
    exclude_tools_when_tool_choice_none: bool = False
    # Idle release (None: [manager]'s default).
    idle_release_s: NonNegativeFloat | None = None
    idle_release: IdleRelease | None = None
    sleep_level: SleepLevel | None = None
    # false: configured and listed, but started by its first request.
    autostart: bool = True
    # true: never released to make room for another model (max_loaded_models).
    pinned: bool = False
    # Its footprint per device before its engine measured one (bytes or "6GiB"); else estimated
    # from its checkpoint and KV cache (servectl/memory.py).
    expected_memory: int | str | None = None
    # Per-model override of [gateway] hold_timeout_s (a cold load of a big model takes minutes).
    hold_timeout_s: PositiveFloat | None = None
    # LoRA adapters served beside the model (vLLM's --lora-modules; needs engine_args.enable_lora):
    # a table name = path, or a list of "name=path" strings or {name, path, base_model_name}
    # tables. finalize() makes it a list of LoraModule.
    lora_modules: dict[str, str] | list[str | LoraModule] = []
    # vLLM's KV-cache events (engine_args.kv_events_config; servectl/kv_events.py says who may
    # read them): `kv_events_token_ids` publishes BlockStored whole — each block's token ids
    # (the prompt), extra keys (cache_salt, media ids), session ids — only over ipc://;
    # `kv_events_network` lets a TCP endpoint be off loopback (block hashes only, unauthenticated).
    kv_events_token_ids: bool = False
    kv_events_network: bool = False
    # A model spread over hosts ([cluster] names them): the first is its head (its engine and
    # its first ranks), each runs an equal share of the ranks, in order (docs/cluster.md).
    hosts: list[str] = []


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Hosts that serve one model together (docs/cluster.md): every host runs servectl from
    the same file; a model's head dials nobody, its other hosts' managers dial the head."""

    hosts: dict[str, str] = {}  # name -> the host's IP address on the cluster's network
    # Which of ``hosts`` this one is; "" finds it by its address being on this machine.
    this_host: str = ""
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 7470  # the head's manager listens here
    # The shared secret (a file readable by its owner only: never argv or the environment).
    secret_file: str = ""
    # A silent host (its link cut, its machine gone) is given up on after this long (TCP
    # keepalive: the kernel's timer, not ours), its ranks' group restarted when it is back.
    dead_after_s: Annotated[float, msgspec.Meta(ge=2)] = 6.0


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    manager: ManagerConfig = msgspec.field(default_factory=ManagerConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    models: list[ModelConfig] = msgspec.field(default_factory=list)


class ConfigError(Exception):
    pass


class IdlePolicy(msgspec.Struct, frozen=True, kw_only=True):
    """A model's effective idle-release settings: its own, else [manager]'s."""

    after_s: float  # 0: never released
    mode: IdleMode  # as configured (the engine may fall back to unload)
    sleep_level: int

    @classmethod
    def of(cls, model: ModelConfig, manager: ManagerConfig) -> "IdlePolicy":
        return cls(after_s=manager.idle_release_s if model.idle_release_s is None else model.idle_release_s,
                   mode=model.idle_release or manager.idle_release,
                   sleep_level=model.sleep_level or manager.sleep_level)


# Engine settings every group gets unless the config overrides them: eager
# mode (no compile step at start) and an explicit KV cache, so a CPU engine
# does not reserve most of the machine's memory.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 256 * 1024 * 1024,
}


# The model keys that are `vllm serve` frontend flags (vLLM's FrontendArgs), refused in engine_args.
FRONTEND_KEYS = frozenset({
    "enable_auto_tool_choice", "tool_call_parser", "tool_parser_plugin", "tool_strict_level", "chat_template",
    "chat_template_content_format", "default_chat_template_kwargs", "exclude_tools_when_tool_choice_none",
    "trust_request_chat_template", "lora_modules",
})
# What of a model's settings its answers depend on (output_identity), besides model and engine_args.
_OUTPUT_KEYS = ("env", "override_generation_config", "tensor_parallel_size", *sorted(FRONTEND_KEYS))


def default_model() -> ModelConfig:
    return ModelConfig(name=DEFAULT_MODEL_NAME, model=str(DEFAULT_MODEL_DIR))


REDACTED = "<redacted>"


def redacted(cfg: Config) -> Config:
    """A copy to show (terminals, logs, CI output): API keys and a model's env values hidden, names kept."""
    out = msgspec.convert(msgspec.to_builtins(cfg), Config)
    out.gateway.api_keys = [REDACTED] * len(out.gateway.api_keys)
    out.gateway.admin_keys = [REDACTED] * len(out.gateway.admin_keys)
    for named in out.gateway.keys:
        named.key = REDACTED if named.key is not None else None
    for m in out.models:
        m.env = dict.fromkeys(m.env, REDACTED)
        m.replica_env = [dict.fromkeys(env, REDACTED) for env in m.replica_env]
    return out


def encode(cfg: Config) -> bytes:
    return msgspec.json.encode(cfg)


def decode(data: bytes | str) -> Config:
    return msgspec.json.decode(data, type=Config)


class Overrides(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Options given on `servectl start`'s command line: they stay in force
    across reloads (the manager re-applies them to the re-read file)."""

    runtime_dir: str | None = None
    state_dir: str | None = None
    host: str | None = None
    port: int | None = None
    gateways: int | None = None
    freeze_grace_s: float | None = None
    api_key_file: str | None = None
    model: str | None = None
    name: str | None = None
    tensor_parallel_size: int | None = None
    engine_args: dict[str, Any] = {}


def output_identity(model: ModelConfig) -> str:
    """What a model's outputs depend on — its weights' path, engine arguments, environment,
    generation defaults, tensor parallelism, its chat settings — as a short digest: a request
    that began on one never goes on on another (api_gateway/sequences.py). Idle release, holds,
    devices and autostart change no output and are left out."""
    import hashlib

    terms = {"model": model.model, "engine_args": model.engine_args,
             **{key: getattr(model, key) for key in _OUTPUT_KEYS}}
    return hashlib.sha256(msgspec.json.encode(terms, order="sorted")).hexdigest()[:16]
