"""Messages on the manager's control (ROUTER) socket: children's reports, clients' requests
(the CLI, the library, gateways' HTTP admin routes), the manager's replies and what it tells
an engine. What a status reply and the events (PUB) socket say of the tree is
servectl/wire/status.py's.

One tagged union per direction; every frame is decoded with a typed decoder so
a malformed or unknown frame is dropped (and logged), never a crash.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from servectl.config import LoraModule, ModelConfig, NamedKey
from servectl.wire.status import BudgetStatus, ChildStatus, ModelStatus
# In the unions below, and named as control's (MP.Admit) where they are used.
from servectl.wire.tenancy import (Admit, Admitted, Finished, LimitKind, UsageReply, UsageRequest,  # noqa: F401
                                   UsageRow, Window)
from servectl.wire.vocab import (AVAILABLE, ChildState, EventKind, EventState, ExitCode, IdleMode,  # noqa: F401
                                 ManagerState, ModelState, ReleaseMode)

PROTOCOL_VERSION = 1


class _Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True):
    pass


# ---- children → manager -------------------------------------------------

class ChildReady(_Msg, tag="child_ready"):
    """Sent once by a child when it can do its job (readiness is never a timer).

    An engine says what it serves with: its model length, the idle release mode in
    force (a configured "sleep" falls back to "unload" where vLLM has no sleep mode)
    and the accelerator memory it holds (None: no accelerator)."""

    component: str
    pid: int
    incarnation: str = ""
    max_model_len: int | None = None
    idle_release: IdleMode | None = None
    device_memory_bytes: int | None = None
    # The LoRA adapters the engine loaded at start (EngineSpec.loras less any that failed).
    loras: list[LoraModule] | None = None
    # What the model holds per device now it is loaded, as the engine measured it, and how
    # (engine_core/footprint.py): the manager's memory budget counts it from then on.
    footprint_bytes: int | None = None
    footprint_source: str = ""


class GroupFrozen(_Msg, tag="group_frozen"):
    """The engine froze (frozen=True) or thawed its workers."""

    model: str
    frozen: bool
    # With frozen=True: when (wall clock) the engine's last request finished.
    idle_since: float | None = None


class GroupIdle(_Msg, tag="group_idle"):
    """The engine has had nothing unfinished for its idle_release_s: the manager may release it."""

    model: str
    incarnation: str
    idle_s: float


class GroupReleased(_Msg, tag="group_released"):
    """The engine's answer to ``Release``.

    released=False: a request arrived meanwhile, it serves on. released=True:
    it refuses every new request from now on (``RequestError.released``) and,
    for mode "sleep", vLLM's sleep mode has given the accelerator memory back.
    """

    model: str
    incarnation: str
    released: bool
    mode: IdleMode = IdleMode.UNLOAD
    # Accelerator memory in use on the group's devices after the release (None: no accelerator).
    device_memory_bytes: int | None = None


class GroupDrained(_Msg, tag="group_drained"):
    model: str
    incarnation: str


class EngineFailed(_Msg, tag="engine_failed"):
    """The engine cannot load its model for a reason a restart cannot fix (missing
    files, an invalid engine argument, an unsupported architecture, not enough
    memory): the group fails at once with ``reason`` (one line) instead of being
    restarted. The engine waits for the manager's ``Ack``, then exits with
    ``ExitCode.PERMANENT``."""

    model: str
    incarnation: str
    reason: str


class StepDeadlineChanged(_Msg, tag="step_deadline"):
    """The engine's deadline for a worker's reply to a step, derived from the steps it has
    seen, changed (published once the engine is warm, then when it moves by a fifth)."""

    model: str
    incarnation: str
    seconds: float


class GroupHung(_Msg, tag="group_hung"):
    """A gateway saw no engine output for too long while requests were in flight."""

    model: str
    incarnation: str


class KeysApplied(_Msg, tag="keys_applied"):
    """A gateway now checks requests against the API keys the manager last sent it (``ApiKeys``)."""

    component: str
    pid: int


# ---- clients → manager ---------------------------------------------------

class StatusRequest(_Msg, tag="status"):
    pass


class LogTail(_Msg, tag="log_tail"):
    """Gateway → manager: a component's output lines after the ``after``-th (0: its last ones
    kept in memory), for the status page's live log. Owner only: logs can hold request text."""

    component: str
    after: int = 0


class WaitSettled(_Msg, tag="wait_settled"):
    """Reply when every model is ready or failed (the CLI's `start` waits on it)."""


class StopRequest(_Msg, tag="stop"):
    timeout_s: float | None = None


class HttpCaller(msgspec.Struct, kw_only=True, frozen=True):
    """Who sent a command over the gateway's HTTP management routes (the audit log's "who"
    for those: the manager sees only the gateway process)."""

    key_id: str | None  # the key's fingerprint, or a named key's name (never the key); None: no valid key was sent
    address: str  # the client's address as the gateway saw it
    gateway: str  # the gateway's component name
    route: str = ""  # the HTTP method and path


# The operator's model verbs (load, unload, restart) are answered when their change is done
# (manager/verbs.py). ``wait_s`` bounds the caller's wait: None waits until the change is done or
# fails (each change has its own bound: drain and stop, or the model's hold timeout); 0 answers once
# it is under way. Past it the answer is an ``Ack(done=False)`` and the change goes on; the same verb
# sent again waits for the one under way. Callers wait at most this long for any answer.
MAX_VERB_WAIT_S = 3600.0
WaitS = Annotated[float, msgspec.Meta(ge=0, le=MAX_VERB_WAIT_S)]


class RestartRequest(_Msg, tag="restart"):
    model: str | None = None
    http: HttpCaller | None = None
    wait_s: WaitS | None = None


class SetFreezing(_Msg, tag="set_freezing"):
    """Enable or disable freezing idle workers of a model (a diagnostic)."""

    model: str
    enabled: bool
    http: HttpCaller | None = None


class ReloadRequest(_Msg, tag="reload"):
    """Re-read the config file, re-apply the start options, apply the difference."""


class LoadModel(_Msg, tag="load"):
    model: ModelConfig
    wait_s: WaitS | None = None


class LoadConfigured(_Msg, tag="load_configured"):
    """Start serving a model of the configuration that is not served now (it was unloaded)."""

    name: str
    http: HttpCaller | None = None
    wait_s: WaitS | None = None


class UnloadModel(_Msg, tag="unload"):
    name: str
    http: HttpCaller | None = None
    wait_s: WaitS | None = None


# How long the manager waits for an engine to load or unload an adapter (it reads the files
# between two steps); callers (the CLI, a gateway) wait a little longer for the manager's answer.
LORA_CHANGE_TIMEOUT_S = 120.0


class LoadLora(_Msg, tag="load_lora"):
    """Load a LoRA adapter into a serving model (``/v1/load_lora_adapter``, `servectl lora load`);
    ``model`` None: the one model with ``enable_lora``. Answered with ``LoraReply`` once its engine
    has loaded it (or refused it)."""

    lora: LoraModule
    model: str | None = None
    load_inplace: bool = False  # vLLM's: replace an adapter of that name (its weights changed)
    http: HttpCaller | None = None


class UnloadLora(_Msg, tag="unload_lora"):
    """Stop serving a LoRA adapter (``/v1/unload_lora_adapter``, `servectl lora unload`)."""

    name: str
    model: str | None = None
    http: HttpCaller | None = None


class HttpRefused(_Msg, tag="http_refused"):
    """A gateway refused a management call (no key, or not an admin key): for the audit log only."""

    http: HttpCaller
    status: int
    reason: str
    # Refusals the gateway did not send on their own since its last one (a flood is summarised).
    suppressed: int = 0


class WakeModel(_Msg, tag="wake"):
    """A gateway holds a request for a released (or never started) model: bring it back."""

    model: str


class LoraDone(_Msg, tag="lora_done"):
    """The engine's answer to ``AddLora`` / ``RemoveLora``: done, or refused with vLLM's reason
    (``status``: the HTTP status the caller gets), and the adapters it serves now."""

    model: str
    incarnation: str
    call_id: int
    ok: bool
    status: int = 200
    message: str = ""
    loras: list[LoraModule] = []
    files: bool = False  # refused reading the adapter's path: an HTTP caller is told no more (issue 53)


ControlIn = Union[ChildReady, GroupFrozen, GroupHung, GroupDrained, GroupIdle, GroupReleased, EngineFailed,
                  StepDeadlineChanged, KeysApplied, LoraDone, LoadLora, UnloadLora,
                  StatusRequest, WaitSettled, StopRequest, RestartRequest, SetFreezing, ReloadRequest, LoadModel,
                  LoadConfigured, UnloadModel, HttpRefused, WakeModel, LogTail, Admit, Finished, UsageRequest]

# What the read-only socket (control-ro) takes, the questions that change nothing: the CLI
# sends these there (a group-shared runtime directory's group may reach it), everything else
# to the owner's control socket; the manager refuses anything else there.
READ_ONLY = (StatusRequest, WaitSettled, UsageRequest)


# ---- manager → clients ---------------------------------------------------

class StatusReply(_Msg, tag="status_reply"):
    version: int
    instance: str
    manager_pid: int
    started_at: float
    state: ManagerState
    port: int
    host: str
    state_dir: str
    children: list[ChildStatus]
    models: list[ModelStatus]
    # Models of the configuration that are not served now (unloaded); `LoadConfigured` starts one.
    unloaded: list[str] = []
    budget: BudgetStatus = msgspec.field(default_factory=BudgetStatus)


class Ack(_Msg, tag="ack"):
    ok: bool
    message: str = ""
    # False: accepted and still under way when the caller's wait_s ran out (a model verb only).
    done: bool = True


class ApiKeys(_Msg, tag="api_keys"):
    """Manager → gateway: the API keys from now on (a reload rotated them); old ones are refused at once.
    ``named``: the [[gateway.keys]] (their limits, weights and models with them).

    Sent only on the control socket, which only the daemon's own user can reach."""

    keys: list[str]
    admin_keys: list[str] = []
    named: list[NamedKey] = []


class LoraReply(_Msg, tag="lora_reply"):
    """The answer to ``LoadLora`` / ``UnloadLora``: ``status`` as HTTP says it (200 done; 400 a bad
    adapter or request, with the reason; 404 no such model or adapter; 409 the model is not
    serving now), and the model's adapters from now on."""

    ok: bool
    status: int
    message: str
    model: str = ""
    loras: list[LoraModule] = []


class LogLines(_Msg, tag="log_lines"):
    """The lines a ``LogTail`` asked for (those still kept: the last 200) and the count of lines
    the component has written, the next ``after``; ``known``: the component exists."""

    component: str
    lines: list[str]
    written: int
    known: bool = True


ControlOut = Union[StatusReply, Ack, ApiKeys, LoraReply, LogLines, Admitted, UsageReply]


# ---- manager → whoever started it (JSON on the --report-fd pipe, then it exits) ----

class StartupFailed(msgspec.Struct, kw_only=True):
    """The manager could not start (its listening address is taken, another manager
    runs in the directory): one line for the operator, and the exit code the CLI
    gives (2: a usage or config error). Nothing of the tree was left running."""

    message: str
    exit_code: int = ExitCode.USAGE


# ---- manager → engine (over the control socket) ---------------------------

class AbortPeer(_Msg, tag="abort_peer"):
    """A gateway died: drop every request it sent."""

    peer: str


class FreezingControl(_Msg, tag="freezing_control"):
    enabled: bool
    grace_s: float = 0.0  # with enabled: freeze after this long idle


class Drain(_Msg, tag="drain"):
    """Refuse new requests; say GroupDrained once nothing is unfinished."""


class Release(_Msg, tag="release"):
    """Give the memory back if still idle (answered with GroupReleased): "unload" (the manager
    then stops the group) or "sleep" (vLLM's sleep mode at ``level``)."""

    mode: IdleMode = IdleMode.UNLOAD
    level: int = 1


class Wake(_Msg, tag="wake_engine"):
    """Leave sleep mode; the engine says ChildReady again when it serves."""


class AddLora(_Msg, tag="add_lora"):
    """Load a LoRA adapter (vLLM's ``OpenAIServingModels.load_lora_adapter``); answered with ``LoraDone``."""

    call_id: int
    lora: LoraModule
    load_inplace: bool = False


class RemoveLora(_Msg, tag="remove_lora"):
    """Stop serving a LoRA adapter; answered with ``LoraDone``."""

    call_id: int
    name: str


ToEngine = Union[AbortPeer, FreezingControl, Drain, Release, Wake, AddLora, RemoveLora]


control_in_decoder = msgspec.msgpack.Decoder(ControlIn)
control_out_decoder = msgspec.msgpack.Decoder(ControlOut)
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
startup_failed_decoder = msgspec.json.Decoder(StartupFailed)
encoder = msgspec.msgpack.Encoder()
