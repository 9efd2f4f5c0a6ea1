"""manager/cluster_link.py: the handshake both ways, what it refuses, and frames that fail
their check (altered, replayed, reordered, reflected, oversized) closing the link undelivered.
Real sockets on 127.0.0.1; no vLLM, no torch."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket

import pytest

from manager import cluster_link as cl
from servectl.wire import cluster as wire
from servectl.wire.vocab import ChildState

pytestmark = pytest.mark.unit

SECRET = b"a-cluster-secret-of-some-length"
HOSTS = {"m1": "127.0.0.1"}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


class Head:
    """A listening head: each accepted connection's Link, or the exception accept raised."""

    def __init__(self, secret=SECRET, hosts=HOSTS):
        self.secret, self.hosts = secret, hosts
        self.results: asyncio.Queue = asyncio.Queue()

    async def __aenter__(self):
        async def handler(reader, writer):
            try:
                await self.results.put(await cl.accept(reader, writer, self.secret, self.hosts))
            except Exception as exc:
                await self.results.put(exc)
        self.server = await asyncio.start_server(handler, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def result(self):
        return await asyncio.wait_for(self.results.get(), 10)


async def dial_outcome(head: Head, secret=SECRET, host="m1"):
    try:
        return await cl.dial("127.0.0.1", head.port, secret, host)
    except cl.Refusal as exc:
        return exc


async def linked(head: Head):
    member = await cl.dial("127.0.0.1", head.port, SECRET, "m1")
    link = await head.result()
    assert isinstance(link, cl.Link), link
    return link, member


def payload_of(frame: bytes) -> bytes:
    return frame[4 + 32:]


RUN = wire.RunRanks(group="g", incarnation="i1", model="m", config_id="0123456789abcdef",
                    ranks=[wire.RankSpec(rank=1, local_rank=0)], world_size=2, nonce=b"n" * 32,
                    engine_addr="10.0.0.1", engine_port=1234, init_method="tcp://10.0.0.1:29500",
                    worker_reply_timeout_s=30.0)
STATE = wire.RankState(group="g0", incarnation="i1", rank=1, pid=4242, state=ChildState.READY)


def test_good_handshake_then_messages_both_ways():
    async def main():
        async with Head() as head:
            link, member = await linked(head)
            assert (link.peer_host, link.peer_addr) == ("m1", "127.0.0.1")
            assert member.peer_addr == "127.0.0.1"
            await link.send(RUN)
            assert await member.recv() == RUN
            await member.send(STATE)
            await member.send(wire.StopRanks(group="g"))  # a message meant for the other way decodes nowhere
            assert await link.recv() == STATE
            with pytest.raises(cl.LinkClosed):
                await link.recv()  # a StopRanks is not something a member says
            # Both sockets are tuned: the kernel, not a timer, notices a dead peer.
            sock = member._writer.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 6000
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
            member.close()
    run(main())


def test_the_peer_closing_is_link_closed_on_the_other_side():
    async def main():
        async with Head() as head:
            link, member = await linked(head)
            link.close()
            with pytest.raises(cl.LinkClosed, match="closed"):
                await member.recv()
            with pytest.raises(cl.LinkClosed):
                await link.send(RUN)  # closed here: nothing more goes out
    run(main())


def test_wrong_secret_on_the_member():
    async def main():
        async with Head() as head:
            member = await dial_outcome(head, secret=b"another-secret-entirely!")
            assert isinstance(member, cl.Refusal) and "secret" in member.reason
            refused = await head.result()
            assert isinstance(refused, cl.Refusal)
            assert refused.reason == "m1 (127.0.0.1): wrong cluster secret"
            assert SECRET.decode() not in refused.reason
    run(main())


def test_wrong_secret_on_the_head():
    async def main():
        async with Head(secret=b"the-head-has-another-one") as head:
            member = await dial_outcome(head)
            assert isinstance(member, cl.Refusal)
            assert member.reason == "the head at 127.0.0.1 does not hold this cluster's secret"
            assert "wrong cluster secret" in (await head.result()).reason
    run(main())


async def raw_join(port: int, host="m1", protocol=wire.CLUSTER_PROTOCOL):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    m_nonce = os.urandom(32)
    payload = wire.encoder.encode(wire.Join(host=host, nonce=m_nonce, protocol=protocol))
    writer.write((32 + len(payload)).to_bytes(4, "big") + bytes(32) + payload)
    return reader, writer, m_nonce


async def raw_read(reader):
    n = int.from_bytes(await reader.readexactly(4), "big")
    body = await reader.readexactly(n)
    assert body[:32] == bytes(32)
    return wire.head_decoder.decode(body[32:])


def test_a_member_whose_proof_is_wrong_is_refused():
    async def main():
        async with Head() as head:
            reader, writer, m_nonce = await raw_join(head.port)
            challenge = await raw_read(reader)
            assert isinstance(challenge, wire.Challenge)
            assert challenge.proof == cl.derive(SECRET, "servectl-head", m_nonce, challenge.nonce, "m1")
            payload = wire.encoder.encode(wire.Proof(proof=b"x" * 32))
            writer.write((32 + len(payload)).to_bytes(4, "big") + bytes(32) + payload)
            assert await raw_read(reader) == wire.Refused(reason="wrong cluster secret")
            assert (await head.result()).reason == "m1 (127.0.0.1): wrong cluster secret"
            writer.close()
    run(main())


def test_another_protocol_is_refused():
    async def main():
        async with Head() as head:
            reader, writer, _ = await raw_join(head.port, protocol=wire.CLUSTER_PROTOCOL + 1)
            refused = await raw_read(reader)
            assert isinstance(refused, wire.Refused) and "protocol" in refused.reason
            assert isinstance(await head.result(), cl.Refusal)
            writer.close()
    run(main())


def test_unknown_host_is_refused():
    async def main():
        async with Head() as head:
            member = await dial_outcome(head, host="stranger")
            assert isinstance(member, cl.Refusal) and "'stranger' is not in the head's cluster config" in member.reason
            refused = await head.result()
            assert isinstance(refused, cl.Refusal) and "stranger" in refused.reason
    run(main())


def test_a_known_name_from_another_address_is_refused():
    async def main():
        async with Head(hosts={"m1": "10.9.8.7"}) as head:
            member = await dial_outcome(head)
            assert isinstance(member, cl.Refusal) and "127.0.0.1 is not m1's address" in member.reason
            assert "10.9.8.7" not in member.reason  # an unproven member is not told the config
            refused = await head.result()
            assert isinstance(refused, cl.Refusal) and "10.9.8.7" in refused.reason
    run(main())


def test_addresses_compare_as_addresses():
    async def main():
        async with Head(hosts={"m1": "::ffff:127.0.0.1"}) as head:
            link, member = await linked(head)
            member.close()
    run(main())
    assert not cl._same_ip("not-an-ip", "127.0.0.1")


def test_an_altered_frame_is_not_delivered():
    async def main():
        async with Head() as head:
            link, member = await linked(head)
            frame = member._seal(STATE)
            at = frame.index(b"g0", 36)
            altered = frame[:at] + b"g1" + frame[at + 2:]
            # Without the MAC check this would arrive as a valid RankState of group g1.
            assert wire.member_decoder.decode(payload_of(altered)).group == "g1"
            member._writer.write(altered)
            with pytest.raises(cl.LinkClosed, match="MAC"):
                await link.recv()
            member.close()
    run(main())


def test_a_replayed_frame_closes_the_link():
    async def main():
        async with Head() as head:
            link, member = await linked(head)
            frame = member._seal(STATE)
            member._writer.write(frame + frame)
            assert await link.recv() == STATE
            with pytest.raises(cl.LinkClosed, match="MAC"):
                await link.recv()
            with pytest.raises(cl.LinkClosed):
                await link.recv()  # and stays closed
            member.close()
    run(main())


def test_reordered_and_reflected_frames_close_the_link():
    async def main():
        async with Head() as head:
            link, member = await linked(head)
            first, second = member._seal(STATE), member._seal(wire.RankState(
                group="g0", incarnation="i1", rank=1, pid=None, state=ChildState.EXITED))
            member._writer.write(second + first)
            with pytest.raises(cl.LinkClosed, match="MAC"):
                await link.recv()
            member.close()
            # The member's own frame 0 sent back to it (a message a head could send, so it would
            # decode): the direction is in the MAC, so it is not the head's frame 0.
            link2, member2 = await linked(head)
            reflected = member2._seal(wire.StopRanks(group="g"))
            assert wire.head_decoder.decode(payload_of(reflected)) == wire.StopRanks(group="g")
            link2._writer.write(reflected)
            with pytest.raises(cl.LinkClosed, match="MAC"):
                await member2.recv()
            link2.close()
    run(main())


def test_an_oversized_length_is_refused_before_the_body():
    async def main():
        async with Head() as head:
            link, member = await linked(head)
            # No body follows: a reader that waited for it would hang here (wait_for fails the test).
            member._writer.write((32 + cl.FRAME_MAX + 1).to_bytes(4, "big"))
            with pytest.raises(cl.LinkClosed, match="frame of"):
                await asyncio.wait_for(link.recv(), 5)
            link2, member2 = await linked(head)
            member2._writer.write((31).to_bytes(4, "big"))  # shorter than a MAC
            with pytest.raises(cl.LinkClosed, match="frame of"):
                await asyncio.wait_for(link2.recv(), 5)
            member.close()
            member2.close()
    run(main())


def test_an_oversized_handshake_frame_is_refused():
    async def main():
        async with Head() as head:
            reader, writer = await asyncio.open_connection("127.0.0.1", head.port)
            writer.write((32 + cl.HANDSHAKE_MAX + 1).to_bytes(4, "big"))
            refused = await head.result()
            assert isinstance(refused, cl.Refusal) and "frame of" in refused.reason
            writer.close()
    run(main())


def test_a_silent_peer_is_refused_after_the_timeout(monkeypatch):
    monkeypatch.setattr(cl, "HANDSHAKE_TIMEOUT_S", 0.2)

    async def main():
        async with Head() as head:
            reader, writer = await asyncio.open_connection("127.0.0.1", head.port)
            refused = await head.result()
            assert isinstance(refused, cl.Refusal) and "did not finish the handshake" in refused.reason
            assert await reader.read() == b""  # and the head hung up
            writer.close()
        # A head that accepts and says nothing.
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(cl.Refusal, match="did not finish the handshake"):
            await cl.dial("127.0.0.1", port, SECRET, "m1")
        server.close()
    run(main())


def test_tune_socket_sets_the_kernel_timeouts():
    with socket.socket() as sock:
        cl.tune_socket(sock, 6.0)
        opt = lambda name: sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))  # noqa: E731
        assert (opt("TCP_KEEPIDLE"), opt("TCP_KEEPINTVL"), opt("TCP_KEEPCNT")) == (2, 1, 4)
        assert opt("TCP_USER_TIMEOUT") == 6000 and opt("TCP_NODELAY")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        cl.tune_socket(sock, 1.0)
        assert (opt("TCP_KEEPIDLE"), opt("TCP_KEEPCNT"), opt("TCP_USER_TIMEOUT")) == (1, 1, 1000)


def test_derive_prefixes_each_part_with_its_length():
    assert cl.derive(SECRET, "l", "ab", "c") != cl.derive(SECRET, "l", "a", "bc")
    assert cl.derive(SECRET, "l", "x") != cl.derive(SECRET, "lx")
    assert cl.derive(SECRET, "l", "é") == cl.derive(SECRET, "l", "é".encode())
    expected = hmac.new(SECRET, b"".join(len(p).to_bytes(8, "big") + p for p in (b"l", b"ab", b"c")),
                        hashlib.sha256).digest()
    assert cl.derive(SECRET, "l", b"ab", "c") == expected
    assert cl.derive(SECRET, "l", "ab") != cl.derive(b"x" + SECRET, "l", "ab")


def secret_file(tmp_path, content=b"  " + SECRET + b"\n", mode=0o600):
    path = tmp_path / "cluster.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_read_secret_reads_a_private_file(tmp_path):
    assert cl.read_secret(secret_file(tmp_path)) == SECRET
    assert cl.read_secret(str(secret_file(tmp_path, mode=0o400))) == SECRET


def test_read_secret_refuses_a_file_others_can_read(tmp_path):
    path = secret_file(tmp_path, mode=0o644)
    with pytest.raises(cl.ClusterSecretError, match="group or others") as info:
        cl.read_secret(path)
    assert str(path) in str(info.value) and SECRET.decode() not in str(info.value)


def test_read_secret_refuses_a_symlink(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(secret_file(tmp_path))
    with pytest.raises(cl.ClusterSecretError, match="symbolic link"):
        cl.read_secret(link)


def test_read_secret_refuses_a_short_secret(tmp_path):
    with pytest.raises(cl.ClusterSecretError, match="holds 15 bytes.*at least 16"):
        cl.read_secret(secret_file(tmp_path, content=b"  " + b"x" * 15 + b" \n"))
    assert cl.read_secret(secret_file(tmp_path, content=b"x" * 16)) == b"x" * 16


def test_read_secret_refuses_other_owners_and_odd_files(tmp_path, monkeypatch):
    with pytest.raises(cl.ClusterSecretError, match="not a regular file"):
        cl.read_secret(tmp_path)
    with pytest.raises(cl.ClusterSecretError, match="cannot be opened"):
        cl.read_secret(tmp_path / "missing")
    path = secret_file(tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)
    with pytest.raises(cl.ClusterSecretError, match="owned by uid"):
        cl.read_secret(path)
