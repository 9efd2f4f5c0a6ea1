"""A warm standby: an interpreter that has already imported torch and vLLM.

Most of an engine's or worker's start is importing (seconds of CPU per
process); loading the model and sizing the KV cache come after. The manager
keeps one standby per group member, exec'd with that member's exact
environment, so a group restart after a crash hands each role to a process
that only has to load the model.

    python -m engine_core.standby --channel-fd N

The standby says ``L`` once it would die with the manager, imports, says ``W`` (warm) on its
channel and then sleeps in
``recvmsg`` until the manager sends a ``Role`` with the role's descriptors
attached, or closes the channel (then it exits 0). It never touches a device
before it has a role: on a GPU host it holds no GPU memory.

It imports at the lowest CPU and I/O priority the kernel offers (servectl/priority.py): a
standby warming beside a serving model takes only cores nothing else wants. The role runs at
the serving priority again (the manager restores it as it hands the role over; the standby
once more before it runs the role, for a thread born meanwhile).
"""

from __future__ import annotations

import argparse
import socket
import sys

import msgspec

from servectl import priority
from servectl.wire.spawn import Role, model_of, parse_component, resolve_fd_args
from servectl.proc import die_with_parent, setup_child_logging

MAX_ROLE_BYTES = 1 << 20
MAX_FDS = 64


def preload() -> None:
    """Import what an engine and a worker import before they touch the model."""
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm.engine.arg_utils import EngineArgs  # noqa: F401
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401
    from vllm.v1.outputs import AsyncModelRunnerOutput  # noqa: F401
    from vllm.v1.serial_utils import run_method  # noqa: F401
    from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: F401
    # What an engine's RequestBuilder and tokenizer endpoints import (vLLM's OpenAI server classes).
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: F401
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: F401
    from vllm.entrypoints.serve.tokenize.serving import TokenizerInfo  # noqa: F401

    import engine_core.main  # noqa: F401
    from engine_core import workers

    workers.preload()


def wait_for_role(channel: socket.socket) -> tuple[Role, list[int]] | None:
    msg, fds, _flags, _addr = socket.recv_fds(channel, MAX_ROLE_BYTES, MAX_FDS)
    if not msg:
        return None  # the manager let us go
    return msgspec.json.decode(msg, type=Role), fds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_core.standby")
    ap.add_argument("--channel-fd", type=int, required=True)
    ap.add_argument("--component", default="standby", help="its name in status (standby:<member>), for its log")
    args = ap.parse_args(argv)
    die_with_parent()
    # Before any other thread exists: the import's threads (torch's, OpenMP's) inherit it.
    serving, _lowered = priority.lower()
    # The format (text or JSON) is in the member's environment it was exec'd with; the role's
    # main sets logging up again under the role's own name (setup_child_logging's force).
    parsed = parse_component(args.component)
    log = setup_child_logging("standby", args.component,
                              model_of(parsed.model) if parsed is not None and parsed.model else None)
    channel = socket.socket(fileno=args.channel_fd)
    try:
        # "L": it dies with the manager now (die_with_parent) and imports at idle priority, so the
        # manager may stop it while a model serves (manager/standbys.py: pace); not before this.
        channel.sendall(b"L")
    except OSError:
        pass
    try:
        preload()
    except Exception:
        # Whatever broke here breaks the cold start too, where it is reported
        # in the role's own log; a standby just does not stand by.
        log.exception("preloading failed")
        return 1
    try:
        channel.sendall(b"W")
    except OSError:
        pass  # the manager closed its end: it sent a role while we imported, or let us go
    got = wait_for_role(channel)
    channel.close()
    if got is None:
        return 0
    role, fds = got
    priority.restore(serving)  # (the manager did as it sent the role; a thread born since too)
    role_argv = resolve_fd_args(role.argv, fds)
    sys.argv = [f"python -m {role.module}", *role_argv]
    if role.module == "engine_core":
        from engine_core.main import main as role_main
    else:
        from engine_core.workers import worker_main as role_main
    return role_main(role_argv)


if __name__ == "__main__":
    raise SystemExit(main())
