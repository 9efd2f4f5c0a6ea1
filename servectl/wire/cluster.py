"""Messages between hosts' managers: the head of a model spread over several hosts and the
members that run its ranks (manager/cluster_link.py frames and authenticates them).

The link is opened by a member (it dials its head) and proven both ways with the cluster
secret before anything else crosses (``Join`` / ``Challenge`` / ``Proof``); after that every
frame carries an HMAC over the session key, its direction and its sequence number, checked
before it is decoded. Nothing on this link is ever unpickled: msgpack of these structs only.

One tagged union per direction (``HEAD_TO_MEMBER``, ``MEMBER_TO_HEAD``); a frame that does not
decode as one is a protocol error that closes the link, never a crash.
"""

from __future__ import annotations

from typing import Union

import msgspec

from servectl.wire.vocab import ChildState

CLUSTER_PROTOCOL = 1


class _Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True):
    pass


# ---- the handshake (before the session key exists) ----------------------------

class Join(_Msg, tag="join"):
    """Member → head, the first frame: who it says it is and its half of the nonce."""

    host: str
    nonce: bytes
    protocol: int = CLUSTER_PROTOCOL


class Challenge(_Msg, tag="challenge"):
    """Head → member: its half of the nonce and proof that it holds the secret."""

    nonce: bytes
    proof: bytes


class Proof(_Msg, tag="proof"):
    """Member → head: proof that it holds the secret (over both nonces and its name)."""

    proof: bytes


class Refused(_Msg, tag="refused"):
    """Head → member, then the link is closed: why (never anything about the secret). A member
    whose check of the head's proof fails also sends one ("wrong cluster secret"), for the head's log."""

    reason: str


# ---- head → member ---------------------------------------------------------------

class RankSpec(msgspec.Struct, kw_only=True, frozen=True):
    """One rank the member runs: which, and where it dials its engine."""

    rank: int
    local_rank: int


class RunRanks(_Msg, tag="run_ranks"):
    """Start these ranks of one engine group's incarnation. The hop key is derived on both
    hosts from the cluster secret and ``nonce`` (never sent); the ranks dial the engine at
    ``engine_addr``:``engine_port`` and meet the others at ``init_method`` (torch's rendezvous).

    The model is named, never described: the member runs it as its own configuration file
    says (path, engine arguments, env), and only if that configuration's identity is
    ``config_id`` too. A head can ask for nothing the member's operator did not configure."""

    group: str
    incarnation: str
    model: str
    config_id: str
    ranks: list[RankSpec]
    world_size: int
    nonce: bytes
    engine_addr: str
    engine_port: int
    init_method: str
    worker_reply_timeout_s: float


class StopRanks(_Msg, tag="stop_ranks"):
    """Stop every rank of ``group`` this member runs (of any incarnation but ``keep``)."""

    group: str
    keep: str = ""


class GroupServing(_Msg, tag="group_serving"):
    """The group this member runs ranks of serves (all its ranks are in): said in their status."""

    group: str
    incarnation: str


HEAD_TO_MEMBER = Union[RunRanks, StopRanks, GroupServing, Refused, Challenge]


# ---- member → head ------------------------------------------------------------------

class RankState(_Msg, tag="rank_state"):
    """A rank this member runs changed state (started, exited)."""

    group: str
    incarnation: str
    rank: int
    pid: int | None
    state: ChildState
    last_exit: str | None = None


MEMBER_TO_HEAD = Union[RankState, Join, Proof]

encoder = msgspec.msgpack.Encoder()
head_decoder = msgspec.msgpack.Decoder(HEAD_TO_MEMBER)  # what a member reads
member_decoder = msgspec.msgpack.Decoder(MEMBER_TO_HEAD)  # what a head reads
