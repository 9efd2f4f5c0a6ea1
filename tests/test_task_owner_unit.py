"""No silent task death (issue 39, item 2): every long-lived task runs under Tasks.keep, which
restarts it when it raises and, past its restarts, takes the process's exit path (TASK_DIED)."""

from __future__ import annotations

import asyncio
import logging
import socket
import tempfile
import types
from pathlib import Path

import pytest
import zmq.asyncio

import servectl.tasks as tasks_mod
from api_gateway.app import Gateway
from api_gateway.manager_link import ManagerLink
from gateway_harness import run
from servectl.config import GatewayConfig
from servectl.tasks import Tasks
from servectl.wire import engine as EP
from servectl.wire.spawn import GatewaySpec
from servectl.wire.vocab import ExitCode, ManagerState

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(tasks_mod, "RESTART_BACKOFF_S", 0.001)
    monkeypatch.setattr(tasks_mod, "RESTART_BACKOFF_MAX_S", 0.01)


def test_a_failing_task_is_restarted_then_given_up_and_a_cancelled_one_ends():
    async def main():
        tasks = Tasks(logging.getLogger("test"))
        calls, gave_up = [], []

        async def flaky():
            calls.append(1)
            if len(calls) < 3:
                raise RuntimeError("boom")
            await asyncio.Event().wait()  # then it runs for good

        task = tasks.keep(flaky, "flaky", give_up=lambda n, e: gave_up.append(n), restarts=3)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(calls) == 3:
                break
        assert len(calls) == 3 and not gave_up and not task.done()
        task.cancel()
        await asyncio.sleep(0)
        assert task.cancelled() or task.done()

        async def always():
            raise OSError("no descriptors")

        task = tasks.keep(always, "always", give_up=lambda n, e: gave_up.append((n, type(e))), restarts=2)
        await asyncio.wait_for(task, 5)
        assert gave_up == [("always", OSError)]

    asyncio.run(main())


def test_the_follow_task_that_raises_once_is_restarted_and_asks_for_a_snapshot_again(monkeypatch):
    async def scenario(h):
        calls = []

        async def follow(self):
            calls.append(1)
            if len(calls) == 1:
                raise zmq.ZMQError(24)  # EMFILE, as in the issue
            await asyncio.Event().wait()

        monkeypatch.setattr(ManagerLink, "follow", follow)
        task = h.gw.manager.tasks.keep(h.gw.manager.follow, "follow the manager", give_up=h.gw.task_died)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(calls) == 2:
                break
        assert len(calls) == 2 and h.gw.exit_code == 0 and not h.gw.stop.is_set()
        task.cancel()

    run(scenario)


def test_a_gateway_whose_follow_task_keeps_dying_exits_task_died(monkeypatch):
    """Gateway.run's own wiring: follow fails past its restarts, the gateway drains and
    returns TASK_DIED (the manager's supervision then starts another)."""
    calls = []

    async def follow(self):
        calls.append(1)
        raise RuntimeError("follow broke")

    monkeypatch.setattr(ManagerLink, "follow", follow)
    tmp = tempfile.mkdtemp(prefix="gwt-", dir="/tmp")
    spec = GatewaySpec(index=0, runtime_dir=tmp, instance="test", gateway=GatewayConfig(), models=["m"],
                       drain_timeout_s=1)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()

    async def main():
        gw = Gateway(spec)
        return await asyncio.wait_for(gw.run(lsock.detach()), 20)

    assert asyncio.run(main()) == ExitCode.TASK_DIED
    assert len(calls) == 4  # the first run and its three restarts


def test_an_engine_reader_that_raises_is_restarted_on_the_same_socket_then_ends_the_gateway():
    async def scenario(h):
        await h.ready()
        link = h.link
        sock = link.sock
        real = link.on_engine_message
        fail = {"left": 1}

        def flaky(msg, incarnation):
            if fail["left"]:
                fail["left"] -= 1
                raise RuntimeError("a handler's bug")
            real(msg, incarnation)

        link.on_engine_message = flaky
        await h.engine.stats_reply()  # eaten by the failing handler
        await asyncio.sleep(0.1)
        # Restarted on the same socket, without a second Hello: the next frame is taken.
        assert link.sock is sock and link.reader is not None and not link.reader.done()
        heard = link.heard
        await h.engine.stats_reply()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if link.heard > heard:
                break
        assert link.heard == heard + 1 and link.is_ready
        assert h.gw.exit_code == 0
        # Failing at every frame: past its restarts the gateway takes its exit path.
        fail["left"] = 100
        for _ in range(5):
            await h.engine.stats_reply()
            await asyncio.sleep(0.05)
        assert h.gw.exit_code == ExitCode.TASK_DIED and h.gw.stop.is_set()
        with pytest.raises(asyncio.TimeoutError):  # no Hello was sent again
            await h.engine.recv(timeout=0.2)

    run(scenario)


def test_the_managers_control_loops_are_restarted_then_the_manager_shuts_down(monkeypatch, tmp_path):
    from manager.control import ControlServer
    from manager.daemon import Manager

    async def main():
        ctx = zmq.asyncio.Context()
        cs = ControlServer(types.SimpleNamespace(state_dir=tmp_path), ctx)
        calls = []

        async def broken(self, sock, via):
            calls.append(via)
            raise zmq.ZMQError(24)

        monkeypatch.setattr(ControlServer, "_serve", broken)
        died = []
        tasks = Tasks(logging.getLogger("test"))
        kept = [tasks.keep(f, name, give_up=lambda n, e: died.append(n)) for name, f in cs.loops()]
        await asyncio.wait_for(asyncio.gather(*kept), 5)
        assert sorted(died) == ["control loop", "control-ro loop"]
        assert calls.count("control") == 4 and calls.count("control-ro") == 4
        ctx.destroy(linger=0)

        # Manager.task_died: the exit path (shutdown, then TASK_DIED), even when the shutdown fails.
        m = Manager.__new__(Manager)
        m.state = ManagerState.RUNNING
        m.tasks = Tasks(logging.getLogger("test"))
        m.exit_code = 0
        m.done = asyncio.Event()
        m.settings = types.SimpleNamespace(drain_timeout_s=1, stop_grace_s=1)
        m.groups = {}

        async def stop_all(_):
            raise OSError("disk full")

        m.gateways = types.SimpleNamespace(stop_all=stop_all)
        m.kill_strays = lambda: None
        m.task_died("control loop", RuntimeError("x"))
        await asyncio.wait_for(m.done.wait(), 5)
        assert m.exit_code == ExitCode.TASK_DIED

    asyncio.run(main())


def test_the_engine_spec_sizes_the_frontend_above_any_generate_from_a_full_body():
    import msgspec

    from servectl.wire.spawn import EngineSpec, engine_max_message_bytes

    assert EngineSpec.__struct_fields__.index("max_body_bytes") >= 0
    body = 4 * 1024 * 1024
    # The worst re-encoding JSON → msgpack: floats in their shortest JSON spelling.
    floats = msgspec.json.decode(b"[" + b",".join([b"1e1"] * (body // 4)) + b"]")
    gen = EP.Generate(request_id="r", kind="completion", body={"prompt": "x", "logit_bias": floats})
    assert len(EP.encoder.encode(gen)) < engine_max_message_bytes(body)
