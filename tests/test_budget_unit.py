"""The memory budget's pure parts (issue 35): sizes, budgets, estimates, who fits, who is evicted,
what an engine measured, and keep-alive comments on a held stream. No daemon, no vLLM."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine_core.footprint import group_footprint, vllm_device_figure
from manager.budget import Budget, Holding, shortfall, too_large
from manager.start_gate import StartGate
from servectl import config as C
from servectl.memory import Amount, check_budget, estimate, parse_amount, parse_size
from servectl.model_check import checkpoint_bytes
from servectl.wire.vocab import ModelState as S

pytestmark = pytest.mark.unit

GiB = 2**30


@pytest.mark.parametrize("value, expected", [
    (1024, 1024), ("1024", 1024), ("24GiB", 24 * GiB), ("512 MiB", 512 * 2**20), ("2GB", 2 * 10**9),
    ("1.5GiB", int(1.5 * GiB)), ("3kb", 3000), ("7TiB", 7 * 2**40)])
def test_sizes(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["", "GiB", "-1", "12 parsecs", 0, -5, True, "1e9", 0.5])
def test_bad_sizes(value):
    with pytest.raises(ValueError):
        parse_size(value)


def test_a_budget_is_bytes_or_a_fraction():
    assert parse_amount(0.8) == parse_amount("0.8") == parse_amount("80%") == Amount(None, 0.8)
    assert parse_amount("8GiB") == Amount(8 * GiB, None)
    assert Amount(None, 0.5).resolve(10 * GiB) == 5 * GiB
    assert Amount(None, 0.5).resolve(None) is None
    for bad in (1.5, 0.0, -0.1, "150%"):
        with pytest.raises(ValueError, match="fraction"):
            parse_amount(bad)


def test_budget_labels_are_gpu_indices_or_cpu():
    assert check_budget({"0": "10GiB", "cpu": 0.5}) == {"0": Amount(10 * GiB, None), "cpu": Amount(None, 0.5)}
    with pytest.raises(ValueError, match="memory_budget.gpu0"):
        check_budget({"gpu0": "1GiB"})
    with pytest.raises(ValueError, match="memory_budget.cpu"):
        check_budget({"cpu": "lots"})


def test_config_errors_name_the_key(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text('[manager]\nmemory_budget = {cpu = "ten"}\n')
    with pytest.raises(C.ConfigError, match="manager.memory_budget.cpu"):
        C.load_config(bad, search=False)
    bad.write_text('[[models]]\nname = "m"\nmodel = "/x"\nexpected_memory = "big"\n')
    with pytest.raises(C.ConfigError, match="models.m.expected_memory"):
        C.load_config(bad, search=False)


def model(**kw) -> C.ModelConfig:
    return C.ModelConfig(name=kw.pop("name", "m"), model=kw.pop("model", "/nowhere"), **kw)


def test_estimates(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 5000)  # a second format: not loaded too
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_bytes(str(tmp_path), {}) == 1000
    m = model(model=str(tmp_path), engine_args={"kv_cache_memory_bytes": 300})
    assert estimate(m, False, None, 1000) == (1300, "checkpoint + KV cache")
    assert estimate(model(expected_memory="2GiB"), True, None, None) == (2 * GiB, "expected_memory")
    # On a GPU without an explicit KV cache, vLLM takes its share of the device.
    assert estimate(model(), True, 80 * GiB, 1000).bytes == int(80 * GiB * 0.9)
    assert estimate(model(engine_args={"gpu_memory_utilization": 0.5}), True, 80 * GiB, 1000).bytes == 40 * GiB
    assert estimate(model(), True, None, 1000).bytes is None  # a device of unknown size
    # On CPU without kv_cache_memory_bytes: VLLM_CPU_KVCACHE_SPACE (GiB), else vLLM's 4 GiB.
    assert estimate(model(env={"VLLM_CPU_KVCACHE_SPACE": "2"}), False, None, 10).bytes == 10 + 2 * GiB
    assert estimate(model(), False, None, 10).bytes == 10 + 4 * GiB
    assert estimate(model(), False, None, None).bytes is None


def test_who_fits():
    limits = {"0": 10, "1": 10}
    held = [Holding("a", ("0",), 6), Holding("b", ("1",), 3)]
    assert shortfall(("1",), 5, None, held, limits) is None
    short = shortfall(("0", "1"), 5, None, held, limits)
    assert short is not None and short.labels == ("0",) and not short.count
    assert shortfall(("0",), 1, 2, held, limits).count  # the cap
    assert shortfall(("cpu",), 100, None, held, limits) is None  # no budget there
    assert shortfall(("0",), None, None, held, limits) is None  # not known: the cap alone decides
    assert too_large(("0",), 11, limits) and too_large(("0",), 10, limits) is None


class Group:
    """What Budget sees of an EngineGroup."""

    def __init__(self, name: str, state, gate: StartGate, devices: str, footprint: int | None,
                 idle_since: float | None = None, pinned: bool = False, expected: int | None = None):
        self.name, self.state, self.idle_since = name, state, idle_since
        self.cfg = model(name=name, devices=devices, pinned=pinned, expected_memory=expected)
        self.host = SimpleNamespace(start_gate=gate)
        self.release_refused, self.freezing = False, True
        self.footprint_bytes, self.footprint_source, self.estimate, self.unfit = footprint, "measured", None, None
        self.evicted: list[str] = []

    def evict(self, reason: str) -> bool:
        self.evicted.append(reason)
        self.state = S.RELEASING
        return True


def budget_of(groups, memory, cap=None) -> Budget:
    gate = groups[0].host.start_gate
    return Budget(cap, {g.name: g for g in groups}, labels=gate.labels, memory=check_budget(memory),
                  estimate=lambda g: estimate(g.cfg, True, None, None))


def test_memory_evicts_the_least_recently_used_on_the_short_device_only():
    async def scenario() -> None:
        gate = StartGate(accelerator=True)
        a = Group("a", S.READY, gate, "0", 6 * GiB, idle_since=1.0)  # the longest idle on device 0
        b = Group("b", S.READY, gate, "1", 6 * GiB, idle_since=0.5)  # idle longest of all, on device 1
        c = Group("c", S.READY, gate, "0", 3 * GiB, idle_since=2.0)
        d = Group("d", S.RELEASED, gate, "0", None, expected=4 * GiB)
        budget = budget_of([a, b, c, d], {"0": "10GiB", "1": "10GiB"})
        why = budget.admit(d)
        assert why and "memory_budget 0: 9.0 GiB of 10.0 GiB in use, 4.0 GiB needed" in why
        assert not b.evicted, "b holds nothing on device 0"
        assert a.evicted and "model d needs room" in a.evicted[0] and not c.evicted
        assert budget.last_eviction is not None and budget.last_eviction.model == "a"

    asyncio.run(scenario())


def test_a_pinned_or_busy_model_is_never_the_one():
    gate = StartGate(accelerator=True)
    a = Group("a", S.READY, gate, "0", 6 * GiB, idle_since=1.0, pinned=True)
    c = Group("c", S.READY, gate, "0", 3 * GiB, idle_since=None)  # a request in flight: not frozen
    d = Group("d", S.RELEASED, gate, "0", None, expected=4 * GiB)
    budget = budget_of([a, c, d], {"0": "10GiB"})
    assert "none can be released now" in budget.admit(d)
    assert not a.evicted and not c.evicted and budget.waiting == [d]


def test_a_model_larger_than_its_budget_alone_is_unfit_not_waiting():
    gate = StartGate(accelerator=True)
    big = Group("big", S.RELEASED, gate, "0", None, expected=12 * GiB)
    budget = budget_of([big], {"0": "10GiB"})
    why = budget.unfit(big)
    assert why and "needs 12.0 GiB on device 0, whose memory_budget is 10.0 GiB" in why and "expected_memory" in why
    big.footprint_bytes = 11 * GiB  # measured at a load under a larger budget
    assert "measured" in budget.unfit(big)
    assert budget_of([big], {"1": "10GiB"}).unfit(big) is None  # its device has no budget


def test_at_start_models_beyond_the_budget_stay_released():
    gate = StartGate(accelerator=False)
    a = Group("a", S.STARTING, gate, "cpu", None, expected=3 * GiB)
    b = Group("b", S.STOPPED, gate, "cpu", None, expected=3 * GiB)
    budget = budget_of([a, b], {"cpu": "5GiB"})
    assert "no room at start: memory_budget cpu" in budget.room_at_start(b)
    assert budget_of([a, b], {"cpu": "6GiB"}).room_at_start(b) is None


def test_footprints_as_the_engine_measures_them():
    # CPU: the group's resident memory; GPU: the largest rank's figure.
    assert group_footprint([(None, 100), (None, 50)], 30) == (180, "RSS (engine and workers)")
    assert group_footprint([(700, 100), (900, 50)], 30) == (900, "vLLM (accelerator)")
    profiled = SimpleNamespace(total_consumed=5, peak_activation_memory=2, available_kv_cache_memory_bytes=10)
    assert vllm_device_figure(profiled, lambda: 0) == 17
    explicit = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=10),
                               model_runner=SimpleNamespace(model_memory_usage=4))
    assert vllm_device_figure(explicit, lambda: 3) == 14
    assert vllm_device_figure(explicit, lambda: 20) == 20  # torch holds more than that


def test_a_held_stream_gets_keep_alive_comments_before_its_first_chunk():
    """SseAnswer against a real aiohttp server: comments while the items are late, none after."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from api_gateway.sse import SseAnswer, after

    async def scenario() -> None:
        held = asyncio.Event()

        async def hold() -> None:
            await held.wait()

        async def items():
            yield "one"
            yield "two"

        async def handler(request: web.Request) -> web.StreamResponse:
            request["request_id"] = "r"
            sse = SseAnswer(request, after(hold, items()), 0.05, 5)
            item = await sse.next_item()
            while item is not None:
                await sse.write(f"data: {item}\n\n".encode())
                item = await sse.next_item()
            await sse.close()
            await sse.resp.write_eof()
            return sse.resp

        app = web.Application()
        app.router.add_get("/", handler)
        async with TestClient(TestServer(app)) as client:
            task = asyncio.ensure_future(client.get("/"))
            await asyncio.sleep(0.3)
            held.set()
            resp = await task
            body = await resp.text()
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        head, _, rest = body.partition("data: one")
        assert head.count(": keep-alive\n\n") >= 2 and head.replace(": keep-alive\n\n", "") == ""
        assert rest == "\n\ndata: two\n\n"

    asyncio.run(scenario())


def test_an_error_before_any_comment_is_a_plain_error():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from api_gateway.sse import SseAnswer, after

    async def scenario() -> None:
        async def hold() -> None:
            raise web.HTTPServiceUnavailable(text="too large")

        async def items():
            yield "never"

        async def handler(request: web.Request) -> web.StreamResponse:
            request["request_id"] = "r"
            sse = SseAnswer(request, after(hold, items()), 5, 5)
            try:
                await sse.next_item()
            finally:
                await sse.close()
            raise AssertionError("unreachable")

        app = web.Application()
        app.router.add_get("/", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/")
            assert resp.status == 503 and await resp.text() == "too large"

    asyncio.run(scenario())


def test_a_model_on_another_device_does_not_wait_behind_one_that_waits_for_room():
    async def scenario() -> None:
        gate = StartGate(accelerator=True)
        a = Group("a", S.READY, gate, "0", 8 * GiB, idle_since=None)  # busy: cannot be evicted now
        d = Group("d", S.RELEASED, gate, "0", None, expected=4 * GiB)
        e = Group("e", S.RELEASED, gate, "1", None, expected=4 * GiB)
        f = Group("f", S.RELEASED, gate, "0", None, expected=1 * GiB)
        budget = budget_of([a, d, e, f], {"0": "10GiB", "1": "10GiB"})
        assert budget.admit(d) is not None and budget.waiting == [d]
        assert budget.admit(e) is None, "device 1 has room: e does not queue behind d"
        assert "d asked first" in budget.admit(f)  # f would fit on device 0, but d asked first

    asyncio.run(scenario())


def test_a_client_gone_during_a_hold_ends_the_wait():
    """The server cancels the handler (aiohttp), or the next comment's write fails: either way the
    held request is given up, not held on until its timeout."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from api_gateway.sse import SseAnswer, after

    async def scenario() -> None:
        outcome: asyncio.Future = asyncio.get_running_loop().create_future()

        async def hold() -> None:
            await asyncio.Event().wait()  # the model never loads

        async def items():
            yield "never"

        async def handler(request: web.Request) -> web.StreamResponse:
            request["request_id"] = "r"
            sse = SseAnswer(request, after(hold, items()), 0.05, 5)
            try:
                await sse.next_item()
                outcome.set_result("an item")
            except (ConnectionError, TimeoutError, asyncio.CancelledError) as exc:
                outcome.set_result(type(exc).__name__)
                raise
            finally:
                await sse.close()
            return sse.resp

        app = web.Application()
        app.router.add_get("/", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/")
            assert await resp.content.readline() == b": keep-alive\n"
            resp.close()  # the client goes away
            assert await asyncio.wait_for(outcome, 10) != "an item"

    asyncio.run(scenario())


def test_a_failed_comment_ends_the_wait_with_the_write_error():
    """Where nothing cancels the handler, the comment's failed write does (ConnectionError raised)."""
    from api_gateway.sse import SseAnswer, after

    async def scenario() -> None:
        async def hold() -> None:
            await asyncio.Event().wait()

        async def items():
            yield "never"

        sse = SseAnswer(None, after(hold, items()), 0.05, 5)

        async def broken(data: bytes) -> None:
            raise ConnectionResetError("gone")

        sse.resp, sse._write = object(), broken  # opened, on a connection that is gone
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(sse.next_item(), 10)
        await sse.close()
        assert asyncio.current_task().cancelling() == 0  # the reader's cancel was taken back

    asyncio.run(scenario())


def test_a_failure_after_a_keep_alive_is_the_streams_error_event():
    """Generator.stream: the hold fails (its timeout, a failed load) once a comment opened the
    response: an SSE error event in OpenAI's shape, then [DONE] — not a second status line."""
    import json
    from types import SimpleNamespace

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from api_gateway.errors import EngineUnavailable, unavailable
    from api_gateway.generate import Generator

    async def scenario() -> None:
        async def hold() -> None:
            await asyncio.sleep(0.3)
            raise unavailable(EngineUnavailable("model 'x' is not available (starting) after waiting 0.3s"))

        async def deltas():
            raise AssertionError("the engine is never asked")
            yield  # noqa: unreachable: an async generator

        run = SimpleNamespace(deltas=deltas, whole_answer=True)
        cfg = C.GatewayConfig(sse_keep_alive_interval=0.05)
        generator = Generator(cfg, None, lambda: "id", lambda link: None)

        async def handler(request: web.Request) -> web.StreamResponse:
            request["request_id"] = "r"
            request["log"] = {}
            req = SimpleNamespace(stream_options=None, model="x")
            return await generator.stream(request, req, run, None, hold)

        app = web.Application()
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/")
            body = await resp.text()
        assert resp.status == 200 and body.startswith(": keep-alive\n\n")
        events = [line for line in body.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 2
        error = json.loads(events[0][6:])["error"]
        assert "after waiting 0.3s" in error["message"] and error["code"] == "engine_unavailable"
        assert run.whole_answer, "a comment is not part of the answer"

    asyncio.run(scenario())


def test_two_crashed_models_over_the_budget_do_not_wait_for_each_other():
    """Both in backoff, together beyond the budget: the first to ask starts (the other, waiting
    for room, holds nothing meanwhile); the second waits for room behind it."""
    async def scenario() -> None:
        gate = StartGate(accelerator=True)
        a = Group("a", S.BACKOFF, gate, "0", 6 * GiB)
        b = Group("b", S.BACKOFF, gate, "0", 6 * GiB)
        budget = budget_of([a, b], {"0": "10GiB"})
        for g in (a, b):  # as EngineGroup.start: starting once admitted
            g.start = lambda g=g: budget.admit(g) is None and setattr(g, "state", S.STARTING)
        assert budget.admit(a) is not None  # b (backoff) still holds its room: a waits
        assert budget.admit(b) is not None  # behind a
        budget.retry()
        assert a.state is S.STARTING and budget.waiting == [b]

    asyncio.run(scenario())


def test_the_budgets_status_names_each_device_its_models_and_the_last_eviction():
    async def scenario() -> None:
        gate = StartGate(accelerator=True)
        a = Group("a", S.READY, gate, "0", 6 * GiB, idle_since=1.0)
        d = Group("d", S.RELEASED, gate, "0", None, expected=6 * GiB)
        budget = budget_of([a, d], {"0": "10GiB", "1": "10GiB"}, cap=3)
        budget.admit(d)
        st = budget.status()
        assert st.max_loaded_models == 3 and st.loaded == 1  # a releasing still holds its memory
        assert [(x.label, x.used_bytes, x.models) for x in st.devices] == [("0", 6 * GiB, ["a"]), ("1", 0, [])]
        assert st.last_eviction.model == "a" and st.last_eviction.needed_by == "d"

    asyncio.run(scenario())
