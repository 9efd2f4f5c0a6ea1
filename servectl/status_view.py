"""How `servectl status` shows the manager's snapshot: ages, a child's memory and CPU from /proc,
the models table. Pure formatting over ``StatusReply`` fields; no socket, no vLLM."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rich.table import Table

from servectl.proc import stat_fields
from servectl.wire import status as WS
from servectl.wire.vocab import ModelState


def fmt_age(since: float | None) -> str:
    return fmt_seconds(time.time() - since) if since else "-"


def proc_usage(pid: int | None) -> tuple[str, str]:
    if not pid:
        return "-", "-"
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        fields = stat_fields(pid)
        ticks = int(fields[11]) + int(fields[12])
        start = int(fields[19])
        hz = os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = max(1e-3, uptime - start / hz)
        return f"{rss_kb / 1024:.0f} MiB", f"{100 * ticks / hz / age:.1f}%"
    except (OSError, StopIteration, ValueError, IndexError, TypeError):
        return "-", "-"


def fmt_seconds(s: float) -> str:
    s = int(max(0.0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def idle_columns(m: WS.ModelStatus, now: float) -> tuple[str, str]:
    """(idle for, releases in) of one model: how long since its last request, how long it stays loaded."""
    if m.released_since is not None:
        return f"released {fmt_seconds(now - m.released_since)} ago", "-"
    if m.idle_since is None:
        return ("busy" if m.state == ModelState.READY else "-"), "-"
    idle = now - m.idle_since
    if m.release_after_s <= 0:
        return fmt_seconds(idle), "never"
    return fmt_seconds(idle), fmt_seconds(m.release_after_s - idle)


def models_table(models: list[WS.ModelStatus]) -> Table:
    """Per model: state, idle time, time to release, and the memory its engine and workers hold."""
    now = time.time()
    table = Table(show_lines=False)
    for col in ("model", "state", "idle", "releases in", "idle release", "memory held", "accelerator", "footprint",
                "standbys", "adapters"):
        table.add_column(col)
    for m in models:
        idle, release_in = idle_columns(m, now)
        color = {ModelState.READY: "green", ModelState.RELEASED: "blue", ModelState.ASLEEP: "blue",
                 ModelState.FAILED: "red"}.get(m.state, "yellow")
        mode = f"{m.release_mode} after {m.release_after_s:g}s" if m.release_after_s > 0 else "never"
        # Its LoRA adapters (`servectl lora list` names them); "-": it takes none.
        adapters = str(len(m.loras)) if m.lora_enabled else "-"
        table.add_row(m.name, f"[{color}]{m.state}[/{color}]", idle, release_in, mode, fmt_bytes(m.memory_bytes),
                      fmt_bytes(m.device_memory_bytes), fmt_footprint(m), fmt_bytes(m.standby_memory_bytes or None),
                      adapters)
    return table


def fmt_footprint(m: WS.ModelStatus) -> str:
    """What the memory budget counts for the model per device: measured at its last load, or
    estimated before it ("~", and how)."""
    if m.footprint_bytes is None:
        return "-"
    if m.footprint_measured:
        return f"{fmt_bytes(m.footprint_bytes)} measured"
    return f"~{fmt_bytes(m.footprint_bytes)} estimated ({m.footprint_source})"


def budget_table(b: WS.BudgetStatus) -> Table:
    """Per device: its budget, what the loaded models hold there, and which; the cap; the last eviction."""
    cap = f"{b.loaded} of {b.max_loaded_models}" if b.max_loaded_models is not None else f"{b.loaded} (no cap)"
    last = "" if b.last_eviction is None else (
        f"; last eviction {fmt_age(b.last_eviction.at)} ago: {b.last_eviction.model} for {b.last_eviction.needed_by}")
    table = Table(title=f"loaded models: {cap}{last}", show_lines=False)
    for col in ("device", "budget", "in use", "device memory", "models"):
        table.add_column(col)
    for d in b.devices:
        table.add_row(d.label, fmt_bytes(d.budget_bytes) if d.budget_bytes is not None else "none",
                      fmt_bytes(d.used_bytes), fmt_bytes(d.total_bytes), ", ".join(d.models) or "-")
    return table
