"""What the manager hands a child at exec, and the names of the tree's parts.

Specs (``ManagerSpec``, ``EngineSpec``, ``GatewaySpec``) hold secrets (API
keys, a model's ``env``), so they never go on a command line, which every
user of the host can read in ``/proc/<pid>/cmdline``: each is JSON in a
sealed memfd (``spec_fd``) whose descriptor the child inherits
(``pass_fds``, or ``SCM_RIGHTS`` for a warm standby) and reads once
(``read_spec_fd``). Only the descriptor's number is on the argv.

Names are built and parsed here only: ``engine_core:<model>``,
``worker:<model>:<rank>``, ``gateway:<index>``, ``standby:<member>`` and
``model:<name>`` (components in status and events), ``engine:<model>`` and
``gw-<index>-<pid>`` (socket identities). Where these say ``<model>`` they
name an engine group: the model's own name, or ``<model>@<replica>`` for each
replica of a model with ``replicas > 1`` (``group_name``). Model names never
contain ``:`` or ``@`` (``servectl.config.NAME_PATTERN``), so parsing is
unambiguous.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass
from typing import Literal

import msgspec

from servectl.config import NAME_PATTERN, Config, GatewayConfig, LoraModule, ModelConfig, Overrides
from servectl.wire.vocab import REPLICA_MARK, EventKind, IdleMode

# A component name's first part is its kind.
ENGINE, WORKER, GATEWAY, STANDBY, MODEL = (EventKind.ENGINE, EventKind.WORKER, EventKind.GATEWAY, EventKind.STANDBY,
                                           EventKind.MODEL)


class ManagerSpec(msgspec.Struct, kw_only=True):
    """What `servectl start` (or ``Server``) tells ``python -m manager`` (JSON in a memfd: ``--spec-fd``)."""

    config: Config  # the effective configuration
    config_path: str | None = None  # the absolute path it was read from: what `reload` re-reads
    overrides: Overrides | None = None  # start options, re-applied on reload


class EngineSpec(msgspec.Struct, kw_only=True):
    """Everything the manager tells an engine at exec (JSON in a memfd: ``--spec-fd``)."""

    model: ModelConfig
    runtime_dir: str
    incarnation: str
    freezing: bool  # freeze idle workers (`servectl freeze` may change it at run time)
    freeze_grace_s: float  # after this long idle
    worker_reply_timeout_s: float
    step_deadline_multiple: float = 20.0
    step_deadline_floor_s: float = 5.0
    # Idle release (servectl.config.IdlePolicy): say GroupIdle after this long idle (0: never);
    # "sleep" builds the engine with vLLM's sleep mode where the platform has it.
    idle_release_s: float = 0.0
    idle_release: IdleMode = IdleMode.UNLOAD
    sleep_level: int = 1
    # The gateways' gateway.max_body_bytes: the engine's frontend takes no message larger
    # than engine_max_message_bytes(this) (ZMQ_MAXMSGSIZE).
    max_body_bytes: int = 32 * 1024 * 1024
    # The LoRA adapters to load at start: the model's configured ones and those loaded at run
    # time, less those unloaded (the manager's EngineGroup.loras). A configured one that fails
    # to load fails the model (as `vllm serve --lora-modules`); one loaded at run time is dropped.
    loras: list[LoraModule] = []
    # The engine group it serves (group_name: its sockets, its identity, its messages to the
    # manager); "" for a model's only group, named as the model. ``model.name`` is the name its
    # requests use.
    group: str = ""
    replica: int = 0  # which replica of the model (vLLM's ``engine`` label on its metrics)
    # Where its KV-cache events go, if the model publishes them (servectl/kv_events.py): this
    # group's slot (-1: the system picks the port).
    events_slot: int = 0
    # A model spread over hosts (manager/cluster.py): torch's rendezvous (tcp://head:port; ""
    # is a file in the runtime directory), the ranks on other hosts (they dial the listening
    # socket passed as --remote-listen-fd), each rank's index on its host, and how soon the
    # kernel gives up on a silent host.
    init_methods: list[str] = []
    remote_ranks: list[int] = []
    local_ranks: list[int] | None = None
    dead_after_s: float = 6.0

    @property
    def group_name(self) -> str:
        return self.group or self.model.name


def engine_max_message_bytes(max_body_bytes: int) -> int:
    """The largest message an engine takes from a gateway. A Generate carries one prompt of a
    body and the body's other fields, re-encoded as msgpack: text and integers are no larger
    than in JSON, a float is at most 9 bytes for JSON's shortest 4 ("1e1,"), so a Generate is
    under 2.25x its body; a resumed choice adds its output tokens (5 bytes each at most) and
    their text. 4x the body plus 16 MiB (a resume of ~1M tokens) admits every legitimate one."""
    return 4 * max_body_bytes + (16 << 20)


class GatewaySpec(msgspec.Struct, kw_only=True):
    """Everything the manager tells a gateway at exec (JSON in a memfd: ``--spec-fd``)."""

    index: int
    runtime_dir: str
    instance: str
    gateway: GatewayConfig
    models: list[str]
    drain_timeout_s: float = 30.0
    # The key that signs the status page's session cookies (api_gateway/ui.py), the same for every
    # gateway of the daemon; "" (tests): each gateway makes its own.
    ui_secret: str = ""
    # The daemon's state directory: the Files and Batch APIs' store (api_gateway/batch_store.py).
    # "" (tests): under the runtime directory.
    state_dir: str = ""


class Role(msgspec.Struct, kw_only=True):
    """What a warm standby becomes: ``python -m <module> <argv>``, minus the exec.

    An argument ``@fd<N>`` (alone or comma-separated) names the N-th
    descriptor sent with the role; each side puts its own numbers in.
    """

    module: Literal["engine_core", "engine_core.workers.worker"]
    argv: list[str]


def spec_fd(spec: msgspec.Struct, name: str = "servectl-spec") -> int:
    """A sealed memfd holding ``spec`` as JSON, for a child to inherit; the caller closes it after the spawn.

    Not a command-line argument (world-readable) and not a file with a name:
    only a process holding the descriptor, or one allowed to ptrace its holder,
    can read it.
    """
    data = msgspec.json.encode(spec)
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        # Nobody (the child included) can change what the next reader gets.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW |
                    fcntl.F_SEAL_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_spec_fd(fd: int, typ: type):
    """Decode the spec in an inherited memfd (see ``spec_fd``), then close it."""
    try:
        size = os.fstat(fd).st_size
        chunks, offset = [], 0
        while offset < size:
            chunk = os.pread(fd, size - offset, offset)  # the offset may be shared: never read()
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
    finally:
        os.close(fd)
    return msgspec.json.decode(b"".join(chunks), type=typ)


def fd_ref(n: int) -> str:
    """The argv placeholder for the n-th descriptor passed with a role or at exec."""
    return f"@fd{n}"


def resolve_fd_args(argv: list[str], fds: list[int]) -> list[str]:
    """Replace each argument made only of ``@fd<N>`` items (comma-separated) by their descriptors."""

    def is_ref(item: str) -> bool:
        return item.startswith("@fd") and item[3:].isdigit()

    return [",".join(str(fds[int(x[3:])]) for x in arg.split(",")) if arg and all(map(is_ref, arg.split(",")))
            else arg for arg in argv]


# ---- names -------------------------------------------------------------------------

def group_name(model: str, replica: int, replicas: int) -> str:
    """An engine group's name: the model's for its only group, ``<model>@<replica>`` for each of several."""
    return model if replicas == 1 else f"{model}{REPLICA_MARK}{replica}"


def model_of(group: str) -> str:
    """The served model an engine group's name belongs to."""
    return group.partition(REPLICA_MARK)[0]


def engine_component(model: str) -> str:
    return f"{ENGINE}:{model}"


def worker_component(model: str, rank: int) -> str:
    return f"{WORKER}:{model}:{rank}"


def gateway_component(index: int) -> str:
    return f"{GATEWAY}:{index}"


def standby_component(member: str) -> str:
    return f"{STANDBY}:{member}"


def model_component(model: str) -> str:
    return f"{MODEL}:{model}"


def engine_identity(model: str) -> bytes:
    """The engine's identity on the manager's control socket."""
    return f"engine:{model}".encode()


def gateway_identity(index: int, pid: int) -> str:
    """A gateway's identity on engines' and the manager's sockets: unique per process."""
    return f"gw-{index}-{pid}"


def log_file_name(component: str) -> str:
    """``worker:a:0`` → ``worker-a-0.log``."""
    return component.replace(":", "-") + ".log"


@dataclass(frozen=True)
class ComponentName:
    kind: EventKind
    model: str | None = None
    index: int | None = None  # a worker's rank, a gateway's index
    member: str | None = None  # a standby's member component


_MODEL_NAME = re.compile(NAME_PATTERN.removesuffix(r"\Z") + rf"(?:{REPLICA_MARK}(?:0|[1-9][0-9]*))?\Z")
_INDEX = re.compile(r"(0|[1-9][0-9]*)\Z", re.ASCII)  # exactly what str(int) makes


def parse_component(name: str) -> ComponentName | None:
    """The parts of a component name, or None for anything no builder above makes."""
    kind, _, rest = name.partition(":")
    if kind == STANDBY:
        if rest.startswith(f"{STANDBY}:"):
            return None  # no builder makes a standby's standby (and a chain of them must not recurse)
        member = parse_component(rest)
        # Only group members (an engine, a worker) have standbys.
        return ComponentName(STANDBY, member.model, member.index, rest) \
            if member is not None and member.kind in (ENGINE, WORKER) else None
    if kind in (ENGINE, MODEL):
        return ComponentName(EventKind(kind), rest) if _MODEL_NAME.match(rest) else None
    if kind == WORKER:
        model, _, rank = rest.rpartition(":")
        return ComponentName(WORKER, model, int(rank)) if _MODEL_NAME.match(model) and _INDEX.match(rank) else None
    if kind == GATEWAY and _INDEX.match(rest):
        return ComponentName(GATEWAY, None, int(rest))
    return None
