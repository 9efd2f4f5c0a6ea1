"""The tree's state as the manager tells it: each child's and model's status and the memory
budget's (the parts of the control socket's ``StatusReply``, a snapshot), and an ``Event`` for
each change of it, on the manager's events (PUB) socket.
"""

from __future__ import annotations

import msgspec

from servectl.config import LoraModule
from servectl.wire.vocab import ChildState, EventKind, EventState, ModelState, ReleaseMode


# ---- a snapshot's parts (in StatusReply) ---------------------------------------------------

class ChildStatus(msgspec.Struct, kw_only=True):
    component: str
    kind: EventKind
    model: str | None
    pid: int | None
    ppid: int | None
    state: ChildState
    since: float
    started_at: float | None
    restarts: int
    last_exit: str | None  # the last exit in words ("exit code 1", "signal SIGKILL")
    last_log: list[str] = []
    # The last exit as the kernel said it: its status (it exited) or its signal's number (killed).
    exit_code: int | None = None
    exit_signal: int | None = None
    # A model spread over hosts: the host a rank runs on (None: this one), and for a rank this
    # host runs for another's engine, that host (its head).
    host: str | None = None
    head: str | None = None


class ModelStatus(msgspec.Struct, kw_only=True):
    name: str
    state: ModelState
    frozen: bool
    incarnation: str
    reason: str | None = None
    step_deadline_s: float | None = None  # as the engine last published it (None: not warm yet)
    # Idle release: after this long idle (0: never), how ("unload"/"sleep", as in force).
    release_after_s: float = 0.0
    release_mode: ReleaseMode = ""
    # When the last request finished (known once the engine froze its workers); None while busy.
    idle_since: float | None = None
    # When the model was released (state released or asleep).
    released_since: float | None = None
    # Memory the model's engine and workers hold: host RSS, accelerator memory the engine reported.
    memory_bytes: int = 0
    device_memory_bytes: int | None = None
    # Per-model hold timeout for gateways (None: the gateway's).
    hold_timeout_s: float | None = None
    # Restarts of the model's engine group (crashes, hangs, operators' restarts) since it was loaded.
    restarts: int = 0
    start_s: float | None = None  # as in its Event
    config_id: str = ""
    devices: str | None = None  # as configured (CUDA_VISIBLE_DEVICES for its workers)
    lora_enabled: bool = False  # its engine takes LoRA adapters (engine_args.enable_lora)
    loras: list[LoraModule] = []  # the adapters it serves (configured and loaded at run time)
    # What it holds on each of its devices (device_labels): measured by its engine at its last
    # load, else estimated (footprint_source says how); what the memory budget counts.
    footprint_bytes: int | None = None
    footprint_measured: bool = False
    footprint_source: str = ""
    device_labels: list[str] = []
    unfit: str | None = None  # why it cannot be loaded under the memory budget even alone
    standby_memory_bytes: int = 0  # host memory of its warm standbys (not in any budget)


class DeviceBudget(msgspec.Struct, kw_only=True):
    label: str  # a GPU index, or "cpu"
    budget_bytes: int | None  # None: no memory_budget for it
    total_bytes: int | None = None  # the device's memory, where known
    used_bytes: int = 0  # the footprints of the models loaded there
    models: list[str] = []


class LastEviction(msgspec.Struct, kw_only=True):
    model: str  # released
    needed_by: str  # for this model
    reason: str
    at: float


class BudgetStatus(msgspec.Struct, kw_only=True):
    max_loaded_models: int | None = None
    loaded: int = 0  # models holding their memory now
    devices: list[DeviceBudget] = []
    last_eviction: LastEviction | None = None


# ---- events (PUB) ----------------------------------------------------------

class Event(msgspec.Struct, kw_only=True):
    component: str
    kind: EventKind
    model: str | None
    state: EventState  # a ChildState's, a ModelState's value, or ARMED (kind DEADLINE)
    pid: int | None
    time: float
    incarnation: str = ""
    detail: str = ""  # for people: a reason, a last exit, the deadline in seconds
    restarts: int = 0
    # Model events: the model's own hold timeout for gateways (None: the gateway's).
    hold_timeout_s: float | None = None
    # Model events: the longest start of the model measured so far (a held request's wait
    # covers it), and what its outputs depend on (a request never resumes across a change).
    start_s: float | None = None
    config_id: str = ""
    # DEADLINE events: the engine's published step deadline.
    step_deadline_s: float | None = None
    # Model events: the LoRA adapters it serves (requests may name them instead of the model).
    loras: list[LoraModule] = []
    # Model events: it cannot be loaded under the memory budget even alone (detail says why):
    # gateways refuse its requests instead of holding them.
    unfit: bool = False
    # Model events: this engine lifetime was killed as hung (a gateway's GroupHung): its requests
    # that had produced nothing are not sent to the next one (api_gateway/sequences.py).
    hung: bool = False
    # HOST events: the other host that joined or left (a model spread over hosts).
    host: str | None = None


event_decoder = msgspec.msgpack.Decoder(Event)
