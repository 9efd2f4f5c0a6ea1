"""The workers' processes as the engine reaches them: a connection per rank, checked against its pidfd; freezing.

``WorkerProcesses`` is a part of ``WorkerGroup`` (group.py), which keeps the
calls, replies and deadlines; this part keeps the group's sockets (one Unix
stream per rank, link.py), made at the first call, and the pidfds the manager
passed in. A rank on another host dials in over TCP instead and proves itself (remote.py).

Peers. Each rank's connection is made to a path in the runtime directory, which any
process of the owner's uid could have bound instead (a relay that rewrites the unsigned
``TokensReply``). So the peer of every connection (``SO_PEERCRED``) must be the process
behind that rank's pidfd, which the manager passed in; any other is refused (closed,
counted in ``refused_peers``, logged once per rank and pid) and the connection tried
again, as for a worker not listening yet, until the call's deadline.

Freezing. Idle workers are frozen (SIGSTOP through pidfds the manager passed
in) and thawed (SIGCONT) before the next call; a group with a call in flight
is never frozen. See ../shared/DESIGN.md "Frozen when idle".
"""

from __future__ import annotations

import logging
import signal
import socket

import zmq

from engine_core.workers.link import FrameReader, peer_credentials, pidfd_pid
from engine_core.workers.pending_call import WorkerHung
from engine_core.workers.remote import accept_rank

log = logging.getLogger("engine_core.executor")

# How often the first call retries connecting to a worker that is not listening yet
# (it binds its socket before importing vLLM; the engine's first call comes after its own).
CONNECT_RETRY_S = 0.01


class WorkerProcesses:
    """Uses ``WorkerGroup``'s fields: ``worker_paths``, ``pidfds``, ``remote_ranks``, ``remote_listener``,
    ``dead_after_s``, ``signer``, ``check_peers``, ``refused_peers``,
    ``clock``, ``sleep``, ``sockets``, ``readers``, ``frozen``, ``outstanding``, ``on_freeze_change``."""

    def connect(self) -> None:
        """Prepare one connection per rank; each is made by the first call (the worker may still be starting)."""
        self.sockets = [None] * len(self.worker_paths)
        self.readers = [FrameReader() for _ in self.worker_paths]
        self.poller = zmq.Poller()  # it polls plain fds too
        self.wake_poller = zmq.Poller()  # the same fds and the waker (wake_on)
        self._registered_waker = None
        self.rank_of: dict[int, int] = {}  # fd -> rank

    def _connect_rank(self, rank: int, deadline: float) -> socket.socket:
        if rank in self.remote_ranks:
            return self._accept_remote(rank, deadline)
        path = self.worker_paths[rank]
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                why = self._stranger(rank, sock)
                if why is None:
                    break
                sock.close()
                if self.clock() >= deadline:
                    raise WorkerHung(f"worker rank {rank}: {why}")
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if self.clock() >= deadline:
                    raise WorkerHung(f"worker rank {rank} is not listening on {path}: {exc}") from None
            # Only before the group's first call reaches a worker that is still starting
            # (it listens before importing vLLM), bounded by that call's deadline.
            self.sleep(CONNECT_RETRY_S)  # event-proof: a start-up retry, never while serving
        return self._keep(rank, sock)

    def _keep(self, rank: int, sock: socket.socket) -> socket.socket:
        self.sockets[rank] = sock
        self.rank_of[sock.fileno()] = rank
        self.poller.register(sock.fileno(), zmq.POLLIN)
        self.wake_poller.register(sock.fileno(), zmq.POLLIN)
        return sock

    def _accept_remote(self, rank: int, deadline: float) -> socket.socket:
        """Ranks on other hosts dial in (remote.py), in any order: each connection that proves
        to be a rank still missing is kept, until ``rank``'s is in or the deadline passes."""
        while self.sockets[rank] is None:
            missing = {r for r in self.remote_ranks if self.sockets[r] is None}
            got = accept_rank(self.remote_listener, self.signer, missing, deadline, self.dead_after_s)
            if got is None:
                raise WorkerHung(f"worker rank {rank} (on another host) did not connect to the engine in time")
            self._keep(*got)
            log.info("worker rank %d connected from another host", got[0])
        return self.sockets[rank]

    def _stranger(self, rank: int, sock: socket.socket) -> str | None:
        """Why the peer of ``sock`` is not rank ``rank``'s worker, or None when it is (or no pidfd
        was given for it to be checked against: the hop's unit tests' in-process doubles)."""
        if not self.check_peers or rank >= len(self.pidfds):
            return None
        pid, uid, gid = peer_credentials(sock)
        expected = pidfd_pid(self.pidfds[rank])
        if expected is not None and pid == expected:
            return None
        self.refused_peers += 1
        why = (f"refused the connection at {self.worker_paths[rank]}: its peer is pid {pid} (uid {uid}, gid {gid}), "
               f"not the worker's pid {expected if expected is not None else '(exited)'}")
        if (rank, pid) not in self._refusals_logged:
            self._refusals_logged.add((rank, pid))
            log.warning("worker rank %d: %s (%d refused so far); trying again", rank, why, self.refused_peers)
        return why

    def _drop_rank(self, rank: int) -> None:
        sock = self.sockets[rank]
        if sock is not None:
            self.poller.unregister(sock.fileno())
            self.wake_poller.unregister(sock.fileno())
            self.rank_of.pop(sock.fileno(), None)
            sock.close()
            self.sockets[rank] = None
            self.readers[rank] = FrameReader()

    def close(self) -> None:
        for rank in range(len(self.sockets)):
            self._drop_rank(rank)

    # ---- freezing ----------------------------------------------------------------
    def _signal_all(self, sig: int) -> None:
        for fd in self.pidfds:
            try:
                signal.pidfd_send_signal(fd, sig)
            except ProcessLookupError:
                pass  # it died; the manager restarts the group

    def freeze(self) -> bool:
        """Stop the workers; never while a call is in flight. True if frozen now."""
        if not self.frozen and self.pidfds and not self.outstanding:
            self._signal_all(signal.SIGSTOP)
            self.frozen = True
            self.on_freeze_change(True)
        return self.frozen

    def thaw(self) -> None:
        if self.frozen:
            self._signal_all(signal.SIGCONT)
            self.frozen = False
            self.on_freeze_change(False)
