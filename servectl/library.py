"""Library mode: start a server from any Python script, no ``__main__`` guard.

``Server`` execs a private manager (``python -m manager``), the same program
`servectl start` runs, in its own runtime directory and on a free port. No
process of the tree is forked or spawned from the script's interpreter by
multiprocessing, so neither of vLLM's library traps applies: fork after CUDA
or threads, and spawn re-running an unguarded ``__main__``.

The private manager dies with the script: it holds the read end of a pipe
whose write end only the script holds; when the script exits, however it
exits (SIGKILL included), the pipe reaches end of file and the manager stops
the tree. (PR_SET_PDEATHSIG would follow the *thread* that created the
Server, and kill the tree when a short-lived thread ends.)
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import threading
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from servectl.wire import control as P
from servectl import config as C
from servectl.client import ControlClient, NotRunning, StartFailed, spawn_manager, wait_settled
from servectl.messages import last_error, without_tracebacks
from servectl.model_check import check_model_paths
from servectl.paths import UntrustedDirectory, prepare_dirs, resolve_runtime_dir


class ServerError(RuntimeError):
    """The server could not start: the message says why (a taken port, a model path
    that is not a model, a model that failed with its reason and its children's
    last log lines, tracebacks reduced to their exception line)."""


class Connection:
    """A handle on a running daemon: its URL, an OpenAI client, a generate() helper."""

    def __init__(self, runtime_dir: Path, host: str, port: int):
        self.runtime_dir = Path(runtime_dir)
        self.host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.port = port
        self._control = ControlClient(self.runtime_dir)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def client(self, **kwargs):
        """An official `openai` client pointed at this server (needs `pip install openai`)."""
        import openai

        kwargs.setdefault("api_key", os.environ.get("SERVECTL_API_KEY", "unused"))
        return openai.OpenAI(base_url=self.base_url, **kwargs)

    def status(self) -> P.StatusReply:
        return self._control.status()

    def models(self) -> list[str]:
        return [m.name for m in self.status().models]

    def generate(self, prompts: str | list[str], model: str | None = None, **sampling: Any) -> list[str]:
        """Complete each prompt; sampling keywords are the completions API's (max_tokens, temperature, …)."""
        single = isinstance(prompts, str)
        timeout = sampling.pop("timeout", 600)
        body = {"model": model or self.models()[0], "prompt": [prompts] if single else list(prompts), **sampling}
        req = urllib.request.Request(f"{self.base_url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                data = json.load(resp)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise ServerError(f"completion failed ({exc.code}): {detail}") from None
        n = sampling.get("n", 1)
        texts = [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])]
        return texts if n > 1 or not single else texts[:1]


def connect(runtime_dir: str | os.PathLike | None = None) -> Connection:
    """Attach to an already running daemon (default runtime directory lookup)."""
    root = resolve_runtime_dir(runtime_dir)
    st = ControlClient(root).status()  # raises NotRunning with the directory it tried
    return Connection(root, st.host, st.port)


def _stop_tree(proc, pipe_w: int | None, runtime_dir: Path, remove_dir: bool, timeout: float = 60) -> None:
    """Stop a private manager; safe to call twice, from atexit or a finalizer."""
    if proc.poll() is None:
        try:
            ControlClient(runtime_dir, timeout_s=5).request(P.StopRequest(timeout_s=0))
        except (NotRunning, OSError):
            pass
        try:
            proc.wait(timeout)
        except Exception:
            proc.kill()
            proc.wait()
    if pipe_w is not None:
        try:
            os.close(pipe_w)
        except OSError:
            pass
    if remove_dir:
        import shutil

        shutil.rmtree(runtime_dir, ignore_errors=True)


class Server(Connection):
    """A private servectl daemon owned by this script.

    >>> with Server(model="default") as srv:
    ...     srv.generate("def ", max_tokens=16)
    """

    def __init__(self, model: str = C.DEFAULT_MODEL_NAME, *, name: str | None = None,
                 models: list[dict[str, Any]] | None = None, config: str | os.PathLike | None = None,
                 host: str = "127.0.0.1", port: int = 0, tensor_parallel_size: int = 1,
                 engine_args: dict[str, Any] | None = None, gateway_processes: int = 1,
                 runtime_dir: str | os.PathLike | None = None, timeout: float = 600, start: bool = True):
        cfg, _ = C.load_config(config) if config else (C.Config(), None)
        if models:
            cfg.models = [C.ModelConfig(**m) for m in models]
        elif not config:
            path = str(C.DEFAULT_MODEL_DIR) if model == C.DEFAULT_MODEL_NAME else model
            cfg.models = [C.ModelConfig(name=name or (C.DEFAULT_MODEL_NAME if model == C.DEFAULT_MODEL_NAME
                                                      else Path(model).name),
                                        model=path, tensor_parallel_size=tensor_parallel_size,
                                        engine_args=dict(engine_args or {}))]
        cfg.gateway.host = host
        cfg.gateway.port = port
        cfg.gateway.processes = gateway_processes
        self._own_dir = runtime_dir is None
        root = Path(runtime_dir) if runtime_dir else Path(tempfile.mkdtemp(prefix="servectl-lib-"))
        cfg.manager.runtime_dir = str(root)
        self.config = C.finalize(cfg)
        self.timeout = timeout
        self._proc = None
        self._pipe_w: int | None = None
        self._lock = threading.Lock()
        super().__init__(root, host, port)
        if start:
            self.start()

    def start(self) -> "Server":
        with self._lock:
            if self._proc is not None:
                return self
            bad = check_model_paths(self.config)
            if bad:
                raise ServerError("\n".join(bad))
            state = self.config.manager.state_dir
            try:  # made (or checked: an existing one must be ours, not writable by others, not a link)
                log = prepare_dirs(self.runtime_dir, Path(state) if state else None) / "manager.log"
            except UntrustedDirectory as exc:
                raise ServerError(str(exc)) from None
            r, w = os.pipe()  # both ends non-inheritable; r is passed explicitly
            report_r, report_w = os.pipe()  # the manager's startup failure, in one line
            try:
                self._proc = spawn_manager(self.config, log,
                                           extra=["--parent-pipe-fd", str(r), "--report-fd", str(report_w)],
                                           detach=True, pass_fds=(r, report_w))
            except BaseException:
                os.close(report_r)
                raise
            finally:
                os.close(r)
                os.close(report_w)
            self._pipe_w = w
            self._finalizer = weakref.finalize(self, _stop_tree, self._proc, w, self.runtime_dir, self._own_dir)
            atexit.register(self._finalizer)
        try:
            reply = wait_settled(self._control, self._proc.pid, self.timeout, report_fd=report_r)
        except StartFailed as exc:  # e.g. the port is taken: the manager started nothing
            self.stop()
            raise ServerError(str(exc)) from None
        except (NotRunning, TimeoutError) as exc:
            tail = log.read_text(errors="replace").splitlines()[-50:] if log.exists() else []
            why = last_error(tail)
            self.stop()
            raise ServerError(f"servectl did not start: {exc}{': ' + why if why else ''}") from None
        finally:
            os.close(report_r)
        self.port = reply.port
        failed = [m for m in reply.models if m.state not in P.AVAILABLE]
        if failed:
            lines = []
            for m in failed:
                lines.append(f"model {m.name} {m.state}: {m.reason}")
                for c in reply.children:
                    if c.model == m.name and c.last_log:
                        lines += [f"  {c.component}: {line}" for line in without_tracebacks(c.last_log)[-10:]]
            self.stop()
            raise ServerError("\n".join(lines))
        return self

    def stop(self) -> None:
        """Drain nothing, stop everything, wait for the tree to exit."""
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
            atexit.unregister(fin)

    close = stop

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<servectl.Server {self.base_url} runtime={self.runtime_dir}>"
