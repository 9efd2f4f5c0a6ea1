"""Hosts in miniature for tests: network namespaces joined by a bridge, nothing in the root one.

    <prefix>r : the bridge <prefix>br (10.77.0.254/24): the router and the clients
      veth <prefix>v<i> --- eth0 in <prefix>h<i> (10.77.0.<i>/24): one servectl daemon each

The veths are made inside <prefix>r with their peers put straight into each host's namespace,
so no interface ever exists in the root namespace; deleting the namespaces removes them and
the bridge. ``down`` first kills every process left in them (TERM, then KILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


class Topology:
    def __init__(self, prefix: str, hosts: int, subnet: str = "10.77.0"):
        assert len(prefix) <= 8  # interface names: 15 characters at most
        self.prefix = prefix
        self.router_ns = f"{prefix}r"
        self.host_ns = [f"{prefix}h{i + 1}" for i in range(hosts)]
        self.router_ip = f"{subnet}.254"
        self.host_ip = [f"{subnet}.{i + 1}" for i in range(hosts)]

    def namespaces(self) -> list[str]:
        return [self.router_ns, *self.host_ns]

    def up(self) -> "Topology":
        self.down()  # what a crashed run left
        try:
            r, bridge = self.router_ns, f"{self.prefix}br"
            sh("ip", "netns", "add", r)
            sh("ip", "-n", r, "link", "set", "lo", "up")  # the router's clients reach it over lo
            sh("ip", "-n", r, "link", "add", bridge, "type", "bridge")
            sh("ip", "-n", r, "addr", "add", f"{self.router_ip}/24", "dev", bridge)
            sh("ip", "-n", r, "link", "set", bridge, "up")
            for i, (ns, ip) in enumerate(zip(self.host_ns, self.host_ip)):
                veth = f"{self.prefix}v{i + 1}"
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", r, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                sh("ip", "-n", r, "link", "set", veth, "master", bridge)
                sh("ip", "-n", r, "link", "set", veth, "up")
                sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.down()
            raise
        return self

    def pids(self) -> set[int]:
        found: set[int] = set()
        for ns in self.namespaces():
            found |= {int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()}
        found.discard(os.getpid())
        return found

    def down(self) -> list[int]:
        """Kill what runs in the namespaces, delete them; returns the pids that had to be killed."""
        existing = set(sh("ip", "netns", "list", check=False).stdout.split())
        mine = [ns for ns in self.namespaces() if ns in existing]
        left = sorted(self.pids()) if mine else []
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            for pid in self.pids() if mine else ():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while mine and self.pids() and time.monotonic() < deadline:
                time.sleep(0.1)  # a test helper's bounded wait for processes to exit
        for ns in mine:
            sh("ip", "netns", "del", ns, check=False)
        return left

    def exists(self) -> list[str]:
        existing = set(sh("ip", "netns", "list", check=False).stdout.split())
        return [ns for ns in self.namespaces() if ns in existing]

    @contextlib.contextmanager
    def inside(self, ns: str | None = None):
        """Run the calling thread in ``ns`` (the router's by default): sockets it makes, and threads
        it starts, are there. Back to where it was on exit."""
        here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{ns or self.router_ns}", os.O_RDONLY)
        try:
            _setns(there)
            yield
        finally:
            _setns(here)
            os.close(here)
            os.close(there)

    def command(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]


# ---- a router in front of the hosts, and clients -------------------------------------------

def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def get(url: str, timeout: float = 5) -> tuple[int, dict | None]:
    """(status, JSON body or None) of a GET; (0, None) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, _json(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, _json(exc.read())
    except OSError:
        return 0, None


class Router:
    """`vllm-router` (the PyPI package) in the router's namespace, checking each worker's
    ``health_path`` every second; start and stop it from any thread."""

    PORT = 8080

    def __init__(self, topo: Topology, workers: list[str], log_path, health_path: str = "/ready",
                 policy: str = "cache_aware"):
        self.topo, self.workers_urls, self.log_path = topo, workers, log_path
        self.argv = ["vllm-router", "--host", topo.router_ip, "--port", str(self.PORT), "--worker-urls", *workers,
                     "--policy", policy, "--health-check-endpoint", health_path,
                     "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                     "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
                     "--log-level", "error"]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.topo.router_ip}:{self.PORT}"

    def start(self, timeout: float = 60) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.topo.command(self.topo.router_ns, self.argv), stdout=log,
                                         stderr=subprocess.STDOUT, cwd=os.path.dirname(str(self.log_path)))
        deadline = time.monotonic() + timeout
        with self.topo.inside():
            while get(self.url + "/liveness", 2)[0] != 200:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vllm-router exited {self.proc.returncode}:\n{self.tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vllm-router did not listen within {timeout:g} s:\n{self.tail()}")
                time.sleep(0.2)  # a test helper's bounded wait

    def tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def workers(self) -> list[dict]:
        """The router's view of its workers (call from inside the router's namespace)."""
        status, body = get(self.url + "/workers")
        return body["workers"] if status == 200 and body else []

    def healthy(self) -> set[str]:
        return {w["url"] for w in self.workers() if w.get("is_healthy")}

    def stop(self) -> bool:
        """SIGTERM, SIGKILL past 10 s; False if it had to be killed."""
        if self.proc is None or self.proc.poll() is not None:
            return True
        self.proc.terminate()
        try:
            self.proc.wait(10)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False


def stream(url: str, prompt: str, max_tokens: int, model: str = "default", out: dict | None = None) -> dict:
    """One streamed completion from ``url``: its id, when it was sent, each chunk's arrival, and
    how it ended (``done``: [DONE] arrived; ``error``: what went wrong, if anything).

    ``out``, when given, is filled as chunks arrive (another thread may watch it) and returned."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    out = {} if out is None else out
    out.update({"sent": time.monotonic(), "times": [], "done": False, "error": None, "id": None})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    out["done"] = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    out["id"] = out["id"] or chunk.get("id")
                    if chunk.get("error"):
                        out["error"] = chunk["error"]
                    out["times"].append(time.monotonic())
    except Exception as exc:  # noqa: BLE001 - the caller classifies every failure
        out["error"] = repr(exc)
    return out


def longest_gap(results: list[dict]) -> float:
    """The longest wait any client had for its next token (between two tokens of a request, or
    from sending one to its first token), over requests that finished."""
    gaps = [0.0]
    for r in results:
        if r["done"] and r["times"]:
            points = [r["sent"], *r["times"]]
            gaps.append(max(b - a for a, b in zip(points, points[1:])))
    return max(gaps)


class Load:
    """``n`` clients streaming through ``url`` one request after another until the block ends.
    Enter it inside the namespace the clients belong in: its threads start there."""

    def __init__(self, url: str, n: int = 4, max_tokens: int = 24):
        self.url, self.max_tokens = url, max_tokens
        self.results: list[dict] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(i,)) for i in range(n)]

    def client(self, i: int) -> None:
        k = 0
        while not self.done.is_set():
            self.results.append(stream(self.url, f"def load_{i}_{k}(x):", self.max_tokens) | {"client": i})
            k += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for t in self.threads:
            t.join(180)

