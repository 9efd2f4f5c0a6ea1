"""Replicas (issue 36): what a replica's crash and a rolling reload cost clients.

    python -m bench.replicas [--rounds 3] [--out bench/results/<date>-replicas.json]

Each round starts, one after the other, two fresh daemons serving the bundled model (warm
standbys on, as by default): ``replicas = 2`` and one group (today's shape). In each, 8 greedy
streams (ignore_eos, 400 tokens) run, and once every one has 8 tokens the worker of the first
group (``chat@0`` / ``chat``) is SIGKILLed. Figures:

- ``next_token_after_kill_s``: from the kill to the next token of every stream — the slowest
  stream's (those the killed group ran: on another replica at once, or after its restart);
- ``errors`` / ``complete``: client errors, streams with all their tokens;
- ``serving_again_s``: from the kill until the killed group is ready again.

Then, with replicas only, a rolling reload under load (4 streaming clients in a loop) that
changes an engine argument: client errors, the longest gap between two tokens any client saw
while it ran, and how long the reload took; the reload's answer says ``rolled``. The reload
starts once the standbys are warm: how many of them the new groups took is counted (issue 57:
a roll runs on warm interpreters). ``--reload-only``: only these rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.idle_release import IdleDaemon
from bench.resume import Stream
from bench.spread import spread
from servectl.config import DEFAULT_MODEL_DIR

PROMPTS = ["def ", "import ", "class ", "for ", "x = ", "return ", "if ", "with "]
TOKENS = 400


def config_text(replicas: int, max_model_len: int = 512) -> str:
    return ("[gateway]\nhold_timeout_s = 600\n[manager]\nfreeze_grace_s = 1\nbackoff_initial_s = 0.3\n"
            f'[[models]]\nname = "chat"\nmodel = "{DEFAULT_MODEL_DIR}"\nreplicas = {replicas}\n'
            f'engine_args = {{ dtype = "float32", max_model_len = {max_model_len} }}\n')


class Daemon(IdleDaemon):
    def states(self) -> dict[str, str]:
        return {m["name"]: m["state"] for m in self.status()["models"]}

    def pid(self, component: str) -> int:
        return next(c["pid"] for c in self.status()["children"] if c["component"] == component)


def kill_round(replicas: int) -> dict:
    d = Daemon(Path(tempfile.mkdtemp(prefix="servectl-replicas-bench-")), config_text(replicas))
    group = "chat@0" if replicas > 1 else "chat"
    try:
        d.start()
        d.wait_standbys_warm()
        Stream(d.port, "warm ", "chat", 16).run()
        victim = d.pid(f"worker:{group}:0")
        streams = [Stream(d.port, p, "chat", TOKENS) for p in PROMPTS]
        for s in streams:
            s.start()
        for s in streams:
            s.progress.wait(300)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        ready_at: list[float] = []

        def watch() -> None:
            d.wait(lambda: d.pid(f"worker:{group}:0") != victim and d.states()[group] == "ready", 600,
                   f"{group} ready again", interval=0.05)
            ready_at.append(time.monotonic())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for s in streams:
            s.join(600)
        watcher.join(600)
        after = [min((t for t in s.stamps if t > killed), default=None) for s in streams]
        return {
            "replicas": replicas,
            "errors": sum(len(s.errors) for s in streams),
            "complete": sum(bool(s.usage and s.usage["completion_tokens"] == TOKENS) for s in streams),
            "streams": len(streams),
            "next_token_after_kill_s": round(max(t for t in after if t is not None) - killed, 3)
            if all(after) else None,
            "serving_again_s": round(ready_at[0] - killed, 2) if ready_at else None,
        }
    finally:
        d.stop()


def reload_round() -> dict:
    d = Daemon(Path(tempfile.mkdtemp(prefix="servectl-replicas-bench-")), config_text(2))
    try:
        d.start()
        warm = d.wait_standbys_warm()  # the roll passes them on (issue 57): measured with them warm
        stop = threading.Event()
        streams: list[Stream] = []

        def client(i: int) -> None:
            while not stop.is_set():
                s = Stream(d.port, PROMPTS[i], "chat", 300)
                streams.append(s)
                s.run()

        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for c in clients:
            c.start()
        time.sleep(2)  # the load runs before the reload
        d.config.write_text(config_text(2, max_model_len=384))
        began = time.monotonic()
        out = d.cli("reload")
        took = time.monotonic() - began
        stop.set()
        for c in clients:
            c.join(600)
        stamps = [(s, [t for t in s.stamps if began <= t]) for s in streams]
        gaps = [b - a for _, ts in stamps for a, b in zip(ts, ts[1:])]
        taken = {c["pid"] for c in d.status()["children"] if c["kind"] != "standby"} & {c["pid"] for c in warm}
        return {"answer": (out.stdout + out.stderr).strip(), "reload_s": round(took, 1),
                "warm_standbys_taken": len(taken),
                "requests": len(streams), "errors": sum(len(s.errors) for s in streams),
                "longest_gap_s": round(max(gaps), 3) if gaps else None}
    finally:
        d.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replicas")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reload-only", action="store_true", help="only the rolling reload's rounds")
    args = ap.parse_args(argv)
    rounds = []
    for _ in range(args.rounds):
        for replicas in () if args.reload_only else (2, 1):  # alternating, fresh daemons
            rounds.append(kill_round(replicas))
            print(json.dumps(rounds[-1]), flush=True)
        rounds.append({"reload": reload_round()})
        print(json.dumps(rounds[-1]), flush=True)
    summary = {}
    for replicas in (2, 1):
        mine = [r for r in rounds if r.get("replicas") == replicas]
        if not mine:
            continue  # --reload-only
        summary[f"replicas={replicas}"] = {
            "next_token_after_kill_s": spread([r["next_token_after_kill_s"] for r in mine]),
            "serving_again_s": spread([r["serving_again_s"] for r in mine]),
            "errors": sum(r["errors"] for r in mine), "complete": sum(r["complete"] for r in mine),
            "streams": sum(r["streams"] for r in mine)}
    reloads = [r["reload"] for r in rounds if "reload" in r]
    summary["rolling_reload"] = {"errors": sum(r["errors"] for r in reloads),
                                 "requests": sum(r["requests"] for r in reloads),
                                 "longest_gap_s": spread([r["longest_gap_s"] for r in reloads]),
                                 "reload_s": spread([r["reload_s"] for r in reloads]),
                                 "answers": [r["answer"] for r in reloads],
                                 "warm_standbys_taken": [r["warm_standbys_taken"] for r in reloads]}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"tokens": TOKENS, "summary": summary, "rounds": rounds}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
