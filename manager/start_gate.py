"""One start at a time per device: models that share a device start (and profile) one after another.

vLLM measures a device's free memory while an engine starts (its profiling run) and sizes the
KV cache from it, assuming nothing else allocates on the device meanwhile: two engines starting
together on one GPU each see the other's allocations come and go, and one fails or takes too
little (vllm#9198). So a start waits while another model that shares one of its devices is
starting; models on disjoint devices start together. A device is named by a label: a GPU's
index (the model's ``devices``, else the first ``tensor_parallel_size`` GPUs), or ``cpu`` for
host memory on a machine without an accelerator.

``StartGate`` owns the queue; a group asks it before it starts (``EngineGroup.start``) and
tells it when its start is over (it leaves ``starting``), which starts the next one whose
devices are free, in the order they asked. Wakes from sleep do not profile and do not wait.
"""

from __future__ import annotations

import logging
from typing import Iterable, Protocol

from servectl import config as C
from servectl.memory import CPU, device_labels  # noqa: F401 (CPU: the label of host memory)

log = logging.getLogger("manager")


class Startable(Protocol):
    """What the gate reads and does with one engine group (manager/group.py's EngineGroup)."""

    name: str
    cfg: C.ModelConfig  # its devices

    def start(self) -> None: ...


def blocker(labels: Iterable[str], starting: dict[str, tuple[str, ...]]) -> tuple[str, str] | None:
    """(model, label) of a start under way on one of ``labels``, or None: free to start. Pure."""
    mine = set(labels)
    for name, theirs in starting.items():
        shared = sorted(mine & set(theirs))
        if shared:
            return name, shared[0]
    return None


class StartGate:
    def __init__(self, accelerator: bool, groups: dict[str, Startable] | None = None):
        self.accelerator = accelerator
        self.groups = groups  # the served models (a group no longer among them is never started)
        self.starting: dict[Startable, tuple[str, ...]] = {}  # group -> its labels, while it starts
        self.waiting: list[Startable] = []  # in the order they asked

    def labels(self, group: Startable) -> tuple[str, ...]:
        return device_labels(group.cfg, self.accelerator)

    def admit(self, group: Startable) -> str | None:
        """None: ``group`` may start now (its start is counted until ``done``); else why it waits
        (it is queued, and started by ``done`` once its devices are free)."""
        labels = self.labels(group)
        held = blocker(labels, {g.name: ls for g, ls in self.starting.items() if g is not group})
        if held is None:
            self.forget(group)
            self.starting[group] = labels
            return None
        if group not in self.waiting:
            self.waiting.append(group)
        model, label = held
        return f"waiting to start: model {model} is starting on device {label} (one start at a time per device)"

    def done(self, group: Startable) -> None:
        """``group``'s start is over (ready, failed, stopped): start what waited for its devices."""
        if self.starting.pop(group, None) is None:
            return
        for waiting in list(self.waiting):
            if self.groups is not None and self.groups.get(waiting.name) is not waiting:
                self.waiting.remove(waiting)  # removed or replaced (a reload) meanwhile
                continue
            if blocker(self.labels(waiting), {g.name: ls for g, ls in self.starting.items()}) is None:
                self.waiting.remove(waiting)
                log.info("model %s: its devices are free; starting it", waiting.name)
                try:
                    waiting.start()
                except Exception:  # its own failure (a spawn refused): not the caller's, nor the queue's
                    log.exception("model %s: starting it failed", waiting.name)

    def forget(self, group: Startable) -> None:
        """Stopped or removed while waiting: no longer started by ``done``."""
        if group in self.waiting:
            self.waiting.remove(group)

    def is_waiting(self, group: Startable) -> bool:
        return group in self.waiting
