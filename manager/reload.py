"""What a reload changes: a pure function of the served configuration and the new one.

``servectl reload`` (or SIGHUP) re-reads the file and re-applies the start
options; only the models that differ are touched (added ones started,
removed ones drained and stopped, changed ones drained, stopped and started
with the new configuration), and the gateways are replaced one by one only
when the [gateway] section changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from servectl import config as C


@dataclass(frozen=True)
class ReloadPlan:
    added: list[C.ModelConfig]
    removed: list[str]
    changed: list[C.ModelConfig]  # the new configuration of each
    gateway: C.GatewayConfig | None  # the new [gateway] section, if it changed
    manager: C.ManagerConfig

    def summary(self) -> str:
        def names(items) -> str:
            return ", ".join(getattr(m, "name", m) for m in items) or "-"

        return (f"added {names(self.added)}; removed {names(self.removed)}; changed {names(self.changed)}; "
                f"gateway {'changed' if self.gateway is not None else 'unchanged'}")


def plan_reload(served: list[C.ModelConfig], gateway: C.GatewayConfig, new: C.Config) -> ReloadPlan:
    old = {m.name: m for m in served}
    fresh = {m.name: m for m in new.models}
    return ReloadPlan(
        added=[m for name, m in fresh.items() if name not in old],
        removed=[name for name in old if name not in fresh],
        changed=[m for name, m in fresh.items() if name in old and m != old[name]],
        gateway=new.gateway if new.gateway != gateway else None,
        manager=new.manager,
    )
