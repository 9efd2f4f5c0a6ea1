"""Shared fixtures: real daemons with the real vLLM engine and the default model.

Every daemon gets its own runtime directory and a free port (``--port 0``; the
manager reports the port it bound), so tests run beside a user's daemon. A
daemon that a test does not kill is shared (session scope); every daemon's
teardown checks, through the instance tag in /proc, that nothing is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servectl.client import ControlClient  # noqa: E402
from servectl.config import DEFAULT_MODEL_DIR  # noqa: E402
from servectl.proc import processes_of_instance  # noqa: E402

SERVECTL = [sys.executable, "-m", "servectl.cli"]
SHARED_API_KEY = "sk-servectl-test"


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition", diagnose=None):
    """Tests may wait with a deadline (product code may not).

    ``diagnose`` returns text (log tails) worth reading when the wait fails.
    """
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            extra = f"\n{diagnose()}" if diagnose is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(interval)


class Daemon:
    """A servectl daemon started through the CLI, as an operator would."""

    def __init__(self, tmp: Path, config: str = "", args: list[str] | None = None, env: dict | None = None,
                 api_key: str = "unused"):
        self.api_key = api_key
        self.runtime_dir = tmp / "rt"
        self.config_path = tmp / "servectl.toml"
        self.config_path.write_text(config)
        self.args = args or []
        self.env = {**os.environ, **(env or {})}
        self.instance = None
        self.port = None
        self.manager_pid = None

    def cli(self, *args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run([*SERVECTL, *args, "--runtime-dir", str(self.runtime_dir)], capture_output=True,
                              text=True, env=self.env, timeout=timeout, cwd=ROOT)
        if check and proc.returncode != 0:
            raise AssertionError(f"servectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def start(self, expect_ok: bool = True) -> subprocess.CompletedProcess:
        proc = self.cli("start", "--config", str(self.config_path), "--port", "0", *self.args, check=expect_ok)
        st = self.status()
        self.instance = st.instance
        self.port = st.port
        self.manager_pid = st.manager_pid
        return proc

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self):
        return ControlClient(self.runtime_dir).status()

    def child(self, component: str):
        return next(c for c in self.status().children if c.component == component)

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=kw.pop("api_key", self.api_key), max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def standbys(self) -> dict[str, object]:
        """Warm standbys by the member they stand in for (``worker:a:0``)."""
        return {c.component.removeprefix("standby:"): c for c in self.status().children if c.kind == "standby"}

    def wait_standbys_warm(self, count: int, timeout: float = 180) -> dict[str, object]:
        """Until ``count`` standbys have imported vLLM and sleep waiting for a role."""
        return wait_for(lambda: (lambda s: len(s) == count and all(c.state == "ready" for c in s.values()) and s)(
            self.standbys()), timeout, interval=0.5, what=f"{count} warm standbys",
            diagnose=lambda: str(self.standbys()))

    def log(self, component: str) -> str:
        path = self.runtime_dir / "state" / "logs" / f"{component.replace(':', '-')}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tails(self, *components: str, lines: int = 25) -> str:
        """The last lines of each component's log, for a failing test's message."""
        return "\n".join(f"--- {c}\n" + "\n".join(self.log(c).splitlines()[-lines:]) for c in components)

    def tree(self) -> list[int]:
        return processes_of_instance(self.instance) if self.instance else []

    def stop(self) -> None:
        if self.manager_pid is None:
            return
        self.cli("stop", timeout=120)
        wait_for(lambda: not self.tree(), 60, what="every process of the tree to exit")

    def kill_all(self) -> None:
        """Last resort in teardown: SIGKILL whatever of the tree is left."""
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def model_dir() -> Path:
    assert (DEFAULT_MODEL_DIR / "config.json").exists(), "the default model is missing"
    return DEFAULT_MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """The shared daemon: default model, one gateway, a short freeze grace."""
    d = Daemon(tmp_path_factory.mktemp("shared"), api_key=SHARED_API_KEY,
               config=f'[gateway]\napi_keys = ["{SHARED_API_KEY}"]\n[manager]\nfreeze_grace_s = 1.0\n')
    try:
        d.start()
        yield d
    finally:
        try:
            d.stop()
        finally:
            leftover = d.tree()
            d.kill_all()
        assert not leftover, f"processes of the shared daemon left after stop: {leftover}"


def read_stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def context_switches(pids: list[int]) -> int:
    """Voluntary + involuntary switches summed over every thread of every pid."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                for line in (task / "status").read_text().splitlines():
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
            except OSError:
                continue
    return total


def json_lines(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
