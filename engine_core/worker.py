"""One tensor-parallel rank of an engine group: ``python -m engine_core.worker``.

Started by the manager (never by the engine). Binds a ROUTER socket, blocks on
it until its engine's executor sends a signed call, runs the call on vLLM's
``WorkerWrapperBase`` and replies. ROUTER, not REP: a REP socket cannot drop a
bad frame without breaking its send/receive lockstep.

Call frames (after the signature check): ``(call_id, method, args, kwargs,
output_rank)``. Reply: ``(call_id, ok, result_or_error_text)``. Ranks other
than ``output_rank`` reply with None to keep step outputs single-copy.
"""

from __future__ import annotations

import argparse
import os
import traceback
from pathlib import Path

import zmq

from engine_core.signing import BadSignature, Signer, read_key
from servectl.paths import RuntimePaths, bind_private
from servectl.proc import die_with_parent, setup_child_logging

STATS_METHOD = "__servectl_stats__"
# execute_model, then sample_tokens(None) if it returned None: one round trip
# per step instead of two when no request needs a grammar (see ZmqExecutor).
EXECUTE_AND_SAMPLE = "__servectl_execute_and_sample__"


def serve(sock: zmq.Socket, signer: Signer, rank: int, log) -> None:
    # vLLM is imported after the socket is bound so the engine can connect
    # while this process is still paying for `import vllm`.
    from vllm.v1.outputs import AsyncModelRunnerOutput
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    import torch

    # Linux lends AMX tile registers only to a process that asks (arch_prctl);
    # oneDNN asks when it JITs an AMX kernel, but vLLM's own AMX attention
    # kernel does not, and dies of SIGILL if it runs first. Ask up front.
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
    wrapper = WorkerWrapperBase(rpc_rank=rank, global_rank=rank)
    while True:
        frames = sock.recv_multipart(copy=True)  # idle: blocks in the kernel
        if len(frames) < 2:
            signer.rejected += 1
            log.warning("rejected frame: no payload (%d rejected so far)", signer.rejected)
            continue
        peer, body = frames[0], frames[1:]
        try:
            call = signer.loads(body)
            call_id, method, args, kwargs, output_rank = call
        except BadSignature as exc:
            log.warning("rejected frame: %s (%d rejected so far)", exc, signer.rejected)
            continue
        except (TypeError, ValueError) as exc:
            # Signed but not a call tuple: a bug in the signer's peer, still no crash.
            signer.rejected += 1
            log.warning("rejected frame: malformed call (%s) (%d rejected so far)", exc, signer.rejected)
            continue
        if method == STATS_METHOD:
            reply = (call_id, True, {"rejected": signer.rejected, "rank": rank, "pid": os.getpid()})
        else:
            try:
                if method == EXECUTE_AND_SAMPLE:
                    result = wrapper.execute_model(*args)
                    if result is None:
                        result = wrapper.sample_tokens(None)
                else:
                    result = run_method(wrapper, method, args, kwargs or {})
                if isinstance(result, AsyncModelRunnerOutput):
                    result = result.get_output()
                if output_rank is not None and output_rank != rank:
                    result = None
                reply = (call_id, True, result)
            except Exception as exc:  # the executor re-raises it in the engine
                log.exception("call %s failed", method if isinstance(method, str) else "<callable>")
                reply = (call_id, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            sock.send_multipart([peer, *signer.dumps(reply)])
        except Exception as exc:  # e.g. an unpicklable result: report it instead
            sock.send_multipart([peer, *signer.dumps((call_id, False, f"reply not sendable: {exc!r}"))])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_core.worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--key-fd", type=int, required=True)
    args = ap.parse_args(argv)
    die_with_parent()
    log = setup_child_logging(f"worker[{args.model}:{args.rank}]")
    signer = Signer(read_key(args.key_fd))
    path = RuntimePaths(Path(args.runtime_dir)).worker(args.model, args.rank)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    bind_private(sock, path)
    log.info("listening on %s", path)
    serve(sock, signer, args.rank, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
