"""Chaos: mixed load on a real daemon while faults and attacks hit it; nothing may be lost.

    python -m bench.chaos                           # 10 minutes, a fault every 20–40 s
    python -m bench.chaos --duration 90 --gap 6,12  # about what tests/test_chaos.py runs

A daemon with two gateways and warm standbys serves the bundled model, its
state directory (logs, audit log) on a small tmpfs of its own when this runs
as root. Client threads loop over a mix of greedy requests — completions and
chat, streamed and whole, n = 2, logprobs, a stop string — whose answers were
taken once before any fault (the reference). Every ``gap`` seconds one fault
or attack, at random: SIGKILL a worker, the engine, a gateway or a standby;
SIGSTOP a worker (a hang, found at the step deadline); fill the log disk for
a while; a 4 MB ``/tokenize``; three 30 MiB frames on the read-only control
socket; a fake ``GroupHung`` from a process of the owner; 200 idle TCP
connections held open; 200,000 inputs in one ``/v1/embeddings`` (to
``default-embed``, the bundled model served as an embedding model too), four
``/v1/responses`` inputs of 100,000 items at once, each with a small request
beside it that must be answered within ``BESIDE_S``; media parts naming a URL of a
server the run holds (issue 53 item 3: nothing fetched, vLLM's 400s). Pass: no client error but the unavoidable (a request
whose connection was on a gateway that was killed: docs/supervision.md),
every completed answer equal to its reference, nothing running at the end,
the manager's memory bounded. Results go to ``bench/results/<date>-chaos.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.run import DEFAULT_MODEL_DIR, DTYPE, KV_BYTES, MAX_MODEL_LEN, ROOT, free_port, sse_events

MESSAGES = [{"role": "user", "content": "Write a Python function."}]
# name: (path, body); greedy but for n = 2 (vLLM refuses n > 1 with greedy sampling), so an answer
# is the same whatever the faults; the sampled one is checked for its shape (two choices) only.
REQUESTS = {
    "c-stream": ("/v1/completions", {"prompt": "def ", "max_tokens": 48, "ignore_eos": True, "stream": True}),
    "c-whole-n2-logprobs": ("/v1/completions", {"prompt": "import ", "max_tokens": 32, "n": 2, "logprobs": 1,
                                                "ignore_eos": True, "temperature": 0.8}),
    "c-stream-stop": ("/v1/completions", {"prompt": "class ", "max_tokens": 64, "stop": ["return"],
                                          "stream": True}),
    "chat-stream": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "ignore_eos": True,
                                             "stream": True}),
    "chat-whole-logprobs": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 32, "logprobs": True,
                                                     "top_logprobs": 2, "ignore_eos": True}),
}
FAULTS = ("kill-worker", "kill-engine", "stop-worker", "kill-gateway", "kill-standby", "fill-disk",
          "big-tokenize", "oversized-control", "fake-hang", "idle-connections", "big-embeddings", "big-responses",
          "media-fetch")
# What a small request beside an attack may take (the attacks of security issue 53: before, 331 s).
BESIDE_S = 120.0


def status_of(port: int, path: str, body: dict, timeout: float = 300) -> tuple[int, float]:
    """(HTTP status, seconds) of one request, its answer read whole."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.monotonic() - started
    finally:
        conn.close()


def same(name: str, texts: list[str], reference: list[str]) -> bool:
    """An answer as the reference: equal text for a greedy request, as many choices for a sampled one."""
    body = REQUESTS[name][1]
    if body.get("temperature", 0) > 0:
        return len(texts) == len(reference) and all(texts)
    return texts == reference


class Transport(Exception):
    """The connection broke under the request (the gateway it was on died, or closed it)."""


def ask(port: int, path: str, body: dict, timeout: float = 300) -> list[str]:
    """One request's text per choice; an HTTP error or an error event raises RuntimeError."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps({"model": "default", "temperature": 0, **body}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        chat = path.endswith("chat/completions")
        if not body.get("stream"):
            answer = json.loads(resp.read())
            return [c["message"]["content"] if chat else c["text"] for c in answer["choices"]]
        texts: dict[int, str] = {}
        done = False
        for raw in resp:
            if raw.startswith(b"data: [DONE]"):
                done = True
                break
            for ev in sse_events([raw]):
                if "error" in ev:
                    raise RuntimeError(f"error event: {ev['error']}")
                for c in ev.get("choices", []):
                    piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
        if not done:
            raise Transport("the stream ended without [DONE]")
        return [texts[i] for i in sorted(texts)]
    except (ConnectionError, http.client.HTTPException, socket.timeout, OSError) as exc:
        raise Transport(f"{type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


@dataclass
class Outcome:
    name: str
    began: float
    ended: float
    error: str | None = None
    transport: bool = False
    equal: bool | None = None


@dataclass
class Report:
    duration_s: float
    faults: list[tuple[float, str, str]] = field(default_factory=list)  # (time, fault, what happened)
    outcomes: list[Outcome] = field(default_factory=list)
    gateway_kills: list[float] = field(default_factory=list)
    end_running: float | None = None
    manager_rss_mb: float | None = None

    def unavoidable(self, o: Outcome) -> bool:
        """A transport error while a gateway died: its connections die with it (docs/supervision.md)."""
        return o.transport and any(o.began - 1 <= t <= o.ended + 1 for t in self.gateway_kills)

    def errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None and not self.unavoidable(o)]

    def mismatches(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.equal is False]

    def summary(self) -> dict:
        done = [o for o in self.outcomes if o.error is None]
        return {"duration_s": self.duration_s, "requests": len(self.outcomes), "completed": len(done),
                "errors": len(self.errors()), "unavoidable": sum(self.unavoidable(o) for o in self.outcomes),
                "mismatches": len(self.mismatches()), "faults": len(self.faults),
                "faults_by_kind": {k: sum(f[1] == k for f in self.faults) for k in FAULTS},
                "end_running": self.end_running, "manager_rss_mb": self.manager_rss_mb}


class Chaos:
    """Drives a running daemon (its port, runtime and state directories) and hurts it."""

    def __init__(self, port: int, runtime_dir: Path, state_dir: Path, seed: int = 0,
                 disk: Path | None = None):
        self.port = port
        self.runtime_dir = runtime_dir
        self.state_dir = state_dir
        self.disk = disk  # a small filesystem holding the state directory, to fill (None: skip that fault)
        self.rng = random.Random(seed)
        self.reference: dict[str, list[str]] = {}
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    # ---- the daemon's parts ---------------------------------------------------------------
    def status(self):
        from servectl.client import ControlClient

        return ControlClient(self.runtime_dir, timeout_s=30).status()

    def pid_of(self, prefix: str) -> list[int]:
        return [c.pid for c in self.status().children if c.component.startswith(prefix) and c.pid]

    def metric(self, names: tuple[str, ...]) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names))

    # ---- load ---------------------------------------------------------------------------------
    def take_reference(self) -> None:
        for name, (path, body) in REQUESTS.items():
            self.reference[name] = ask(self.port, path, body)

    def client(self, report: Report, index: int) -> None:
        names = list(REQUESTS)
        i = index
        while not self.stopping.is_set():
            name = names[i % len(names)]
            i += 1
            path, body = REQUESTS[name]
            o = Outcome(name, time.monotonic(), 0.0)
            try:
                texts = ask(self.port, path, body)
                o.equal = same(name, texts, self.reference[name])
            except Transport as exc:
                o.error, o.transport = str(exc), True
            except RuntimeError as exc:
                o.error = str(exc)
            o.ended = time.monotonic()
            with self.lock:
                report.outcomes.append(o)

    # ---- faults and attacks --------------------------------------------------------------------
    def fault(self, kind: str, report: Report) -> str:
        if kind in ("kill-worker", "stop-worker", "kill-engine", "kill-gateway", "kill-standby"):
            prefix = {"kill-worker": "worker:", "stop-worker": "worker:", "kill-engine": "engine_core:",
                      "kill-gateway": "gateway:", "kill-standby": "standby:"}[kind]
            pids = self.pid_of(prefix)
            if not pids:
                return "none running"
            pid = self.rng.choice(pids)
            if kind == "kill-gateway":
                report.gateway_kills.append(time.monotonic())
            os.kill(pid, signal.SIGSTOP if kind == "stop-worker" else signal.SIGKILL)
            return f"pid {pid}"
        if kind == "fill-disk":
            if self.disk is None:
                return "skipped (no disk of its own)"
            filler = self.disk / "filler"
            with contextlib.suppress(OSError), open(filler, "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))
            time.sleep(5)  # the daemon serves (and logs) on a full disk meanwhile
            filler.unlink(missing_ok=True)
            return "filled for 5 s"
        if kind == "big-tokenize":
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            try:
                conn.request("POST", "/tokenize", json.dumps({"model": "default", "prompt": "x " * 2_000_000}),
                             {"Content-Type": "application/json"})
                return f"HTTP {conn.getresponse().status}"
            finally:
                conn.close()
        if kind == "oversized-control":
            import zmq

            from servectl.paths import RuntimePaths
            from servectl.wire import control as P

            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(RuntimePaths.ipc(RuntimePaths(self.runtime_dir).control_ro))
                for _ in range(3):
                    sock.send(P.encoder.encode(P.UnloadModel(name="x" * (30 << 20))))
                return "answered" if sock.poll(1000) else "dropped"
            finally:
                sock.close()
        if kind == "fake-hang":
            from servectl.client import ControlClient
            from servectl.wire import control as P

            st = self.status()
            inc = next(m.incarnation for m in st.models if m.name == "default")
            reply = ControlClient(self.runtime_dir).request(P.GroupHung(model="default", incarnation=inc))
            return "refused" if not reply.ok else "ACCEPTED"
        if kind == "media-fetch":
            return self.media_fetch()
        if kind in ("big-embeddings", "big-responses"):
            # Issue 53, items 2 and 5: 200,000 token-id inputs (1.6 MB) to the embedding model, or
            # four Responses inputs of 100,000 items at once; then a small request beside them.
            if kind == "big-embeddings":
                path, big = "/v1/embeddings", {"model": "default-embed", "input": [[5, 6, 7]] * 200_000}
                small = {"model": "default-embed", "input": "def"}
            else:
                path, big = "/v1/responses", {"model": "default", "input": [{"role": "user", "content": "x"}] * 100_000}
                small = {"model": "default", "input": "def", "max_output_tokens": 2}
            at_once = 4 if kind == "big-responses" else 1
            with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
                bigs = list(pool.map(lambda _: status_of(self.port, path, big), range(at_once)))
            status, took = status_of(self.port, path, small)
            if any(s == 200 for s, _ in bigs):
                return "ACCEPTED"
            if status != 200 or took > BESIDE_S:
                return "STALLED"
            return (f"HTTP {sorted({s for s, _ in bigs})} in {max(t for _, t in bigs):.1f}s; "
                    f"one beside them in {took:.1f}s")
        if kind == "idle-connections":
            conns = []
            try:
                for _ in range(200):
                    conns.append(socket.create_connection(("127.0.0.1", self.port), timeout=5))
                texts = ask(self.port, *REQUESTS["c-stream"])  # a new client is still served
                return "served beside 200 idle" if texts == self.reference["c-stream"] else "MISMATCH"
            finally:
                for c in conns:
                    c.close()
        raise ValueError(kind)

    def media_fetch(self) -> str:
        """Issue 53 item 3: media parts naming a URL on a server of our own, typed, untyped and as a
        text part with a ``uuid`` (vLLM reads those by their keys), on every route that takes
        content, to a model that reads no media: vLLM's 400s, the server never asked (a fetch
        fails the fault)."""
        import http.server

        hits: list[str] = []

        class Recorder(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                hits.append(self.path)
                self.send_response(404)
                self.end_headers()

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/media"
        statuses = []
        try:
            for part in ({"image_url": url}, {"type": "image_url", "image_url": {"url": url}},
                         {"type": "text", "text": "hi", "uuid": "u", "image_url": url}):
                msgs = [{"role": "user", "content": [part]}]
                for path, body in (("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}),
                                   ("/v1/responses", {"input": msgs, "max_output_tokens": 2}),
                                   ("/v1/messages", {"messages": msgs, "max_tokens": 2}),
                                   ("/v2/embed", {"inputs": [{"content": [part]}], "input_type": "query",
                                                  "embedding_types": ["float"]})):
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                    try:
                        conn.request("POST", path, json.dumps({"model": "default", **body}),
                                     {"Content-Type": "application/json"})
                        statuses.append(conn.getresponse().status)
                    finally:
                        conn.close()
        finally:
            server.shutdown()
            server.server_close()
        if hits:
            raise RuntimeError(f"an engine fetched a client's URL ({len(hits)} time(s))")
        # The default model reads no media: vLLM's 400 for a part it takes as media; a part it
        # reads as text (Anthropic's converter keeps a text block's text) is answered as text.
        refused = statuses.count(400)
        if set(statuses) <= {200, 400} and refused >= len(statuses) - 3:
            return f"nothing fetched ({refused} of {len(statuses)} refused)"
        return "ACCEPTED"

    def run(self, duration_s: float, gap: tuple[float, float], clients: int = 3,
            kinds: tuple[str, ...] = FAULTS) -> Report:
        report = Report(duration_s)
        self.take_reference()
        threads = [threading.Thread(target=self.client, args=(report, i), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        start = time.monotonic()
        order = list(kinds)
        self.rng.shuffle(order)
        k = 0
        # Every kind at least once, however long the faults before took (a restart on a busy host).
        while time.monotonic() - start < duration_s or k < len(order):
            time.sleep(self.rng.uniform(*gap))
            kind = order[k % len(order)]  # every kind once before any twice
            k += 1
            try:
                what = self.fault(kind, report)
            except Exception as exc:  # noqa: BLE001 - the fault itself failed: say so
                what = f"fault failed: {type(exc).__name__}: {exc}"
            report.faults.append((round(time.monotonic() - start, 1), kind, what))
        self.stopping.set()
        for t in threads:
            t.join(600)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            report.end_running = self.metric(("servectl_requests_running{", "servectl_requests_waiting{"))
            if report.end_running == 0:
                break
            time.sleep(1)
        from servectl.proc import rss_bytes

        report.manager_rss_mb = round(rss_bytes(self.status().manager_pid) / 2**20, 1)
        return report


# ---- a daemon to hurt ----------------------------------------------------------------------------

def config_text(state_dir: Path) -> str:
    return ('[gateway]\nprocesses = 2\nhold_timeout_s = 180\n'
            # a hang on an engine that is not warm yet (just restarted) is found in 20 s, not 120
            f'[manager]\nfreeze_grace_s = 1.0\nbackoff_initial_s = 0.3\nworker_reply_timeout_s = 20\n'
            f'state_dir = "{state_dir}"\n'
            f'[[models]]\nname = "default"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
            f'[models.engine_args]\nenforce_eager = true\nkv_cache_memory_bytes = {KV_BYTES}\n'
            f'max_model_len = {MAX_MODEL_LEN}\ndtype = "{DTYPE}"\n'
            # the target of the big-embeddings attack (security issue 53, item 2)
            f'[[models]]\nname = "default-embed"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
            f'[models.engine_args]\nrunner = "pooling"\nconvert = "embed"\nenforce_eager = true\n'
            f'kv_cache_memory_bytes = {KV_BYTES}\nmax_model_len = {MAX_MODEL_LEN}\ndtype = "{DTYPE}"\n')


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int = 64):
    """A tmpfs of its own at ``path`` (root only); None when it cannot be had."""
    path.mkdir(parents=True, exist_ok=True)
    ok = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
        capture_output=True).returncode == 0
    try:
        yield path if ok else None
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--gap", default="20,40", help="seconds between faults: MIN,MAX")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    gap = tuple(float(x) for x in args.gap.split(","))
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    port = free_port()
    with small_disk(work / "state") as disk:
        state = disk if disk is not None else work / "state"
        cfg = work / "servectl.toml"
        cfg.write_text(config_text(state))
        rt = work / "rt"
        cli = [sys.executable, "-m", "servectl.cli"]
        subprocess.run([*cli, "start", "--config", str(cfg), "--port", str(port), "--runtime-dir", str(rt)],
                       check=True, cwd=ROOT)
        try:
            chaos = Chaos(port, rt, state, args.seed, disk)
            report = chaos.run(args.duration, gap, args.clients)
        finally:
            subprocess.run([*cli, "stop", "--runtime-dir", str(rt)], cwd=ROOT)
    summary = report.summary()
    print(json.dumps(summary, indent=1))
    for t, kind, what in report.faults:
        print(f"{t:7.1f}s {kind:18s} {what}")
    for o in report.errors()[:10]:
        print("ERROR", o.name, o.error)
    stamp = time.strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"{stamp}-chaos"
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "faults": report.faults,
                                                    "errors": [o.__dict__ for o in report.errors()]}, indent=1))
    out.with_suffix(".md").write_text(
        f"# Chaos run, {stamp}\n\n`python -m bench.chaos {' '.join(argv or sys.argv[1:])}`\n\n"
        + "".join(f"- {k}: {v}\n" for k, v in summary.items())
        + "\n| t (s) | fault | what happened |\n|---|---|---|\n"
        + "".join(f"| {t} | {kind} | {what} |\n" for t, kind, what in report.faults))
    ok = not report.errors() and not report.mismatches() and report.end_running == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
