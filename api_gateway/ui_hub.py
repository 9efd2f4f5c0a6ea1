"""The status page's open streams and what they are sent (api_gateway/ui.py serves the page).

``UiHub`` holds the open pages (``Page``: one ``/ui/stream`` each). Manager events go to
every page as they come. The figures without events — RSS and CPU from /proc, requests
running and waiting and tokens generated from the engines' own vLLM metrics, the manager's
status — are sampled by one task that runs only while a page is open (the last one's
``leave`` cancels it), at most once a second, at once after an event; a page gets a
snapshot when one differs from the last (its time aside). A followed log is asked of the
manager (``LogTail``) in the same pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque

from prometheus_client.parser import text_string_to_metric_families

from api_gateway.manager_link import ManagerLink
from servectl.wire import control as MP
from servectl.wire import status as WS
from servectl.wire.spawn import model_of

log = logging.getLogger("api_gateway.ui")

SAMPLE_S = 1.0  # the figures without events: at most this often, only while a page is open
EVENTS_KEPT = 200  # the recent events a page gets when it opens
PENDING_KEPT = 1000  # events and log lines a page that reads nothing is owed, at most (oldest dropped)
# Open pages are connections that never count as idle (http_server.py): capped, so the API keeps its slots.
STREAMS_MAX = 64  # per gateway, and never more than a quarter of its connection cap
STREAMS_PER_ADDRESS = 4  # a browser's tabs; an address holding more is refused
WRITE_TIMEOUT_S = 10.0  # a page that has not taken a write's bytes by then is closed (it reads nothing)


def stream_cap(connections: int) -> int:
    """The pages a gateway with this connection cap holds at most: three quarters of its
    connections are kept for the API, whatever the pages do."""
    return max(1, min(STREAMS_MAX, connections // 4))


def sse(kind: str, data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Page:
    """One open page: what it may see, the log it follows, what it is owed. The latest
    snapshot takes one slot (a slow page skips to the newest); events and log lines queue."""

    def __init__(self, admin: bool, log_component: str | None, token: str, expires_at: float, remote: str = ""):
        self.admin = admin
        self.remote = remote  # the client's address: STREAMS_PER_ADDRESS
        self.scope = ""  # its session's scope (the gateway's port, ui.Sessions)
        self.log_component = log_component
        self.log_after = 0
        self.token = token  # its session: checked again when keys change and as it expires
        self.expires_at = expires_at
        self.pending: deque[bytes] = deque(maxlen=PENDING_KEPT)
        self.snapshot: bytes | None = None
        self.wake = asyncio.Event()
        self.closed = False

    def push(self, data: bytes) -> None:
        self.pending.append(data)
        self.wake.set()

    def push_snapshot(self, data: bytes) -> None:
        self.snapshot = data
        self.wake.set()

    def close(self) -> None:
        """End its stream (the gateway stops; its session no longer opens it): the browser reconnects."""
        self.closed = True
        self.wake.set()

    def take(self) -> bytes:
        data = b"".join(self.pending) + (self.snapshot or b"")
        self.pending.clear()
        self.snapshot = None
        self.wake.clear()
        return data


def proc_figures(pid: int | None) -> tuple[int | None, int | None]:
    """(RSS bytes, CPU ticks so far) of a process, or (None, None)."""
    if not pid:
        return None, None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
        return rss_pages * os.sysconf("SC_PAGE_SIZE"), int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None, None


ENGINE_FIGURES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                  "vllm:generation_tokens": "tokens"}


def engine_figures(text: str) -> dict[str, float]:
    """Requests running and waiting and tokens generated so far, from an engine's vLLM metrics
    (its adapters' requests included: they are its model's)."""
    figures = {"running": 0.0, "waiting": 0.0, "tokens": 0.0}
    try:
        for family in text_string_to_metric_families(text):
            key = ENGINE_FIGURES.get(family.name)
            if key is not None:
                figures[key] += sum(s.value for s in family.samples if not s.name.endswith("_created"))
    except ValueError:
        pass  # not what an engine renders: no figures
    return figures


class Rates:
    """Per-second rates of counters sampled now and then (pure; the caller gives the clock)."""

    def __init__(self):
        self.last: dict[object, tuple[float, float]] = {}

    def rate(self, key, total: float, now: float) -> float | None:
        before = self.last.get(key)
        self.last[key] = (total, now)
        if before is None or now <= before[1]:
            return None
        return max(0.0, total - before[0]) / (now - before[1])

    def keep_only(self, keys: set) -> None:
        self.last = {k: v for k, v in self.last.items() if k in keys}

    def clear(self) -> None:
        self.last.clear()


class UiHub:
    """The pages open on this gateway and what they are sent."""

    def __init__(self, manager: ManagerLink):
        # The manager's link: its status and log tails asked, its engine links and served models.
        self.manager = manager
        self.pages: set[Page] = set()
        self.events: deque[bytes] = deque(maxlen=EVENTS_KEPT)
        self.poke = asyncio.Event()  # an event came: sample now
        self.sampler: asyncio.Task | None = None
        self.last: tuple[dict, bytes] | None = None  # the last snapshot (without its time) and as sent
        self.cpu = Rates()  # pid -> CPU seconds
        self.tokens = Rates()  # model -> tokens generated
        self.hz = os.sysconf("SC_CLK_TCK")
        self.failing = False  # the last sample failed (said once in the log, not every second)

    def on_event(self, ev: WS.Event) -> None:
        data = sse("event", {"time": ev.time, "component": ev.component, "kind": str(ev.kind.value),
                             "model": ev.model, "state": str(getattr(ev.state, "value", ev.state)), "pid": ev.pid,
                             "detail": ev.detail, "restarts": ev.restarts})
        self.events.append(data)
        for page in self.pages:
            page.push(data)
        self.poke.set()

    def refusal(self, remote: str, cap: int) -> str | None:
        """Why a new page from ``remote`` may not open now (this gateway's cap, or its address's), or None."""
        if len(self.pages) >= cap:
            return f"{cap} status pages are open on this server (its cap); close one or try again later"
        if sum(p.remote == remote for p in self.pages) >= STREAMS_PER_ADDRESS:
            return f"{STREAMS_PER_ADDRESS} status pages are open from this address; close one first"
        return None

    def join(self, page: Page, hello: bytes) -> None:
        """A page opens: its hello, the recent events and the last snapshot first, then what comes."""
        page.push(hello + b"".join(self.events))
        if self.last is not None:
            page.push_snapshot(self.last[1])
        self.pages.add(page)
        if self.sampler is None or self.sampler.done():
            self.sampler = asyncio.get_running_loop().create_task(self.sample(), name="ui sampler")

    def leave(self, page: Page) -> None:
        self.pages.discard(page)
        if not self.pages and self.sampler is not None:
            self.sampler.cancel()  # no page: nothing is sampled
            self.sampler = None
            self.last = None
            self.cpu.clear()
            self.tokens.clear()

    def close_all(self) -> None:
        """The gateway stops: every stream ends, the sampler with them."""
        for page in list(self.pages):
            page.close()
        if self.sampler is not None:
            self.sampler.cancel()

    async def sample(self) -> None:
        while self.pages:
            self.poke.clear()
            try:
                await self.sample_once()
                self.failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the page shows the next sample; the gateway serves on
                if not self.failing:
                    log.warning("status page: a sample failed (%s: %s); retrying each second",
                                type(exc).__name__, exc)
                self.failing = True
            try:
                # event-proof: runs only while a page is open (leave() cancels it); an event pokes it.
                await asyncio.wait_for(self.poke.wait(), SAMPLE_S)
            except asyncio.TimeoutError:
                pass

    async def sample_once(self) -> None:
        snap = await self.snapshot()
        if self.last is None or snap != self.last[0]:
            data = sse("snapshot", {**snap, "now": time.time()})
            self.last = (snap, data)
            for page in self.pages:
                page.push_snapshot(data)
        for page in list(self.pages):
            if page.log_component:
                await self.follow_log(page)

    async def follow_log(self, page: Page) -> None:
        reply = await self.manager.ask(MP.LogTail(component=page.log_component, after=page.log_after), 5.0)
        if not isinstance(reply, MP.LogLines):
            return
        if not reply.known:  # not now (a replica being rolled): said once, asked again next time
            if page.log_after >= 0:
                page.push(sse("log", {"component": page.log_component, "lines": [], "unknown": True}))
            page.log_after = -1
            return
        if page.log_after < 0 or reply.written < page.log_after:  # back, or a new process of that name
            page.log_after = 0
            reply = await self.manager.ask(MP.LogTail(component=page.log_component, after=0), 5.0)
            if not isinstance(reply, MP.LogLines):
                return
        if reply.lines or page.log_after == 0:
            page.push(sse("log", {"component": page.log_component, "lines": reply.lines}))
        page.log_after = reply.written

    async def snapshot(self) -> dict:
        st = await self.manager.ask(MP.StatusRequest(), 5.0)
        if not isinstance(st, MP.StatusReply):
            raise RuntimeError("the manager gave no status")
        now = time.monotonic()
        links = list(self.manager.links.items())
        texts = await asyncio.gather(*(link.engine_metrics(0.5) for _, link in links))
        figures: dict[str, dict[str, float]] = {}
        for (group, _), text in zip(links, texts):
            per_model = figures.setdefault(model_of(group), {"running": 0.0, "waiting": 0.0, "tokens": 0.0})
            for key, value in engine_figures(text).items():
                per_model[key] += value
        models: dict[str, dict] = {}
        for m in st.models:
            name = model_of(m.name)
            served = self.manager.models.get(name)
            f = figures.get(name, {})
            rate = self.tokens.rate(name, f.get("tokens", 0.0), now)
            entry = models.setdefault(name, {
                "name": name, "state": str(served.status if served is not None else m.state.value),
                "reason": served.reason if served is not None else m.reason, "groups": [],
                "running": int(f.get("running", 0)),
                # the engines' queues, and what this gateway holds for the model (other gateways' not)
                "waiting": int(f.get("waiting", 0)) + (served.waiting if served is not None else 0),
                "tokens_per_s": None if rate is None else round(rate, 1)})
            entry["groups"].append({
                "name": m.name, "state": m.state.value, "devices": m.devices, "memory_bytes": m.memory_bytes,
                "device_memory_bytes": m.device_memory_bytes, "idle_since": m.idle_since,
                "release_after_s": m.release_after_s, "released_since": m.released_since, "restarts": m.restarts,
                "frozen": m.frozen, "reason": m.reason})
        self.tokens.keep_only(set(models))
        manager = {"component": "manager", "kind": "manager", "model": None, "pid": st.manager_pid,
                   "state": st.state.value, "started_at": st.started_at, "restarts": 0, "last_exit": None}
        processes = [self.process(p, now) for p in [manager, *({
            "component": c.component, "kind": c.kind.value, "model": c.model, "pid": c.pid, "state": c.state.value,
            "started_at": c.started_at, "restarts": c.restarts, "last_exit": c.last_exit} for c in st.children)]]
        self.cpu.keep_only({p["pid"] for p in processes})
        return {"manager": {"pid": st.manager_pid, "started_at": st.started_at, "state": st.state.value,
                            "instance": st.instance},
                "models": sorted(models.values(), key=lambda m: m["name"]), "unloaded": st.unloaded,
                "processes": processes}

    def process(self, p: dict, now: float) -> dict:
        """A process's row with its RSS and CPU: CPU in whole percents and RSS in MiB, so a
        snapshot differs when what the page shows does."""
        rss, ticks = proc_figures(p["pid"])
        cpu = None
        if p["pid"] and ticks is not None:
            rate = self.cpu.rate(p["pid"], ticks / self.hz, now)
            cpu = None if rate is None else round(100 * rate)
        return {**p, "rss_bytes": None if rss is None else rss >> 20 << 20, "cpu_percent": cpu}
