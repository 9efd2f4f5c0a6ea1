"""Issue 36, the pure parts: replicas' names, devices and environments; a gateway's choice of
replica, its word for a model some of whose replicas are missing, and where a request may go on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from api_gateway.engines import EngineLink, EngineUnavailable, LinkState
from api_gateway.served import AFFINITY_ENTRIES, ServedModel, prefix_key
from manager.group import EngineGroup, GroupState
from servectl import config as C
from servectl.wire.spawn import group_name, model_of, parse_component
from test_manager_unit import HostDouble

pytestmark = pytest.mark.unit
L = LinkState


def model(**kw) -> C.ModelConfig:
    return C.finalize(C.Config(models=[C.ModelConfig(name="chat", model="/m", **kw)])).models[0]


# ---- configuration and names ------------------------------------------------------------------

def test_one_device_string_is_split_evenly_in_order_and_a_list_is_one_per_replica():
    assert C.replica_devices(model(replicas=2, tensor_parallel_size=2, devices="0,1,2,3")) == ["0,1", "2,3"]
    assert C.replica_devices(model(replicas=2, devices=["3", "1"])) == ["3", "1"]
    assert C.replica_devices(model(replicas=3)) == [None, None, None]
    assert C.replica_devices(model(devices="5")) == ["5"]
    # Without devices on a GPU host: consecutive GPUs, not every replica on GPU 0.
    assert C.replica_devices(model(replicas=2, tensor_parallel_size=2), accelerator=True) == ["0,1", "2,3"]
    assert C.replica_devices(model(), accelerator=True) == [None]


@pytest.mark.parametrize("kw, words", [
    (dict(replicas=2, devices="0,1,2"), "3 device(s) cannot be split evenly among 2 replicas"),
    (dict(replicas=2, devices=["0"]), "1 device list(s) for 2 replica(s)"),
    (dict(replicas=2, replica_env=[{}]), "replica_env: 1 table(s) for 2 replica(s)"),
])
def test_devices_or_environments_that_do_not_match_the_replicas_are_config_errors(kw, words):
    with pytest.raises(C.ConfigError, match="models.chat") as info:
        model(**kw)
    assert words in str(info.value)


def test_a_replica_group_is_named_after_its_model_and_parses_back():
    assert (group_name("chat", 0, 1), group_name("chat", 0, 2), group_name("chat", 1, 2)) == \
        ("chat", "chat@0", "chat@1")
    assert (model_of("chat@1"), model_of("chat")) == ("chat", "chat")
    assert parse_component("worker:chat@1:0").model == "chat@1"
    assert parse_component("model:chat@1").model == "chat@1"
    assert parse_component("model:chat@") is None and parse_component("model:chat@01") is None
    # A model's own name never holds the mark, so a replica's name cannot be a model's.
    with pytest.raises(msgspec.ValidationError, match="models"):
        msgspec.toml.decode(b'[[models]]\nname = "chat@1"\nmodel = "/m"\n', type=C.Config)


def test_each_replica_is_a_group_with_its_devices_and_environment_and_one_configuration(tmp_path):
    cfg = model(replicas=2, devices="0,1", env={"A": "1", "B": "1"}, replica_env=[{}, {"B": "2"}])
    groups = [EngineGroup(cfg, HostDouble(tmp_path), r) for r in range(2)]
    assert [g.name for g in groups] == ["chat@0", "chat@1"]
    assert [g.model for g in groups] == ["chat", "chat"]
    assert [g.cfg.devices for g in groups] == ["0", "1"]
    assert [g.cfg.env for g in groups] == [{"A": "1", "B": "1"}, {"A": "1", "B": "2"}]
    assert [g.engine.component for g in groups] == ["engine_core:chat@0", "engine_core:chat@1"]
    # Interchangeable mid-request: placement is not part of what the outputs depend on.
    assert groups[0].config_id == groups[1].config_id == C.output_identity(cfg)
    assert [g.model_cfg for g in groups] == [cfg, cfg]


# ---- the gateway's choice -----------------------------------------------------------------------

def link(name: str, state: L = L.READY, outstanding: int = 0, config_id: str = "c1", seqs: int = 4) -> EngineLink:
    out = EngineLink(name, "/nonexistent", None, b"gw", wake=lambda group: None)
    out.state, out.outstanding, out.config_id, out.max_num_seqs = state, outstanding, config_id, seqs
    out.incarnation = "i" if state is L.READY else ""
    return out


def served(*links: EngineLink) -> ServedModel:
    m = ServedModel("chat")
    for one in links:
        m.add(one)
    return m


def test_a_request_goes_to_the_ready_replica_with_the_fewest_sequences_outstanding():
    m = served(link("chat@0", outstanding=3), link("chat@1", outstanding=1), link("chat@2", L.DOWN))
    assert m.pick().model == "chat@1"
    m.links["chat@1"].outstanding = 5
    assert m.pick().model == "chat@0"
    assert served(link("chat@0", L.STARTING)).pick() is None


def test_ties_go_to_the_replica_that_last_served_the_same_prompt_start():
    m = served(link("chat@0"), link("chat@1"))
    a, b = prefix_key({"prompt": "x" * 500 + "a"}), prefix_key({"prompt": "y"})
    assert prefix_key({"prompt": "x" * 500 + "b"}) == a  # the same start: the same key
    m.links["chat@0"].outstanding = 1
    assert m.pick(a).model == "chat@1"  # not a tie: the least loaded, remembered for a
    m.links["chat@0"].outstanding = 0
    assert m.pick(a).model == "chat@1"  # a tie: where a went last
    assert m.pick(b).model == "chat@0"  # a tie, b never seen: the first
    m.links["chat@1"].outstanding = 2
    assert m.pick(a).model == "chat@0"  # load beats the remembered replica


def test_prompt_starts_remembered_are_bounded():
    m = served(link("chat@0"), link("chat@1"))
    for i in range(AFFINITY_ENTRIES + 10):
        m.pick(prefix_key({"prompt": f"{i:08d}"}))
    assert len(m.affinity) == AFFINITY_ENTRIES


def test_prefix_keys_come_from_messages_prompts_or_inputs():
    assert prefix_key({"messages": [{"role": "user", "content": "hi"}]}) is not None
    assert prefix_key({"input": "hi"}) == prefix_key({"prompt": "hi"})
    assert prefix_key({"max_tokens": 3}) is None


def test_a_model_with_replicas_missing_is_degraded_and_still_serves():
    m = served(link("chat@0"), link("chat@1", L.FAILED))
    m.links["chat@1"].reason = "3 exits within 60s"
    assert m.status == "degraded"
    assert m.reason == "1 of 2 replicas serve; chat@1 failed (3 exits within 60s)"
    m.links["chat@1"].state = L.RELEASED  # released for idleness: not missing capacity
    assert m.status == "ready"
    m.links["chat@1"].state = L.STARTING  # a reload's new group, or one coming back
    assert m.status == "ready"
    m.links["chat@1"].state = L.DOWN  # crashed, in backoff
    assert m.status == "degraded"
    m.links["chat@1"].state = L.RELEASED
    m.links["chat@0"].state = L.DOWN
    assert m.status == "released"  # none serves: the word of the one nearest to serving


def test_the_queue_counts_every_ready_replicas_room():
    m = served(link("chat@0", seqs=4), link("chat@1", seqs=4), link("chat@2", L.DOWN, seqs=4))
    m.admitted = 10
    assert m.queued() == 2 and m.queued(3) == 5


def test_a_request_waits_for_a_replica_of_its_configuration_and_ends_when_none_is_left():
    async def scenario():
        m = served(link("chat@0", L.DOWN), link("chat@1", L.STARTING))
        waiter = asyncio.ensure_future(m.wait_ready(5, config_id="c1"))
        await asyncio.sleep(0)
        assert m.waiting == 1
        m.links["chat@1"]._swap(frozenset(L), L.READY)
        await asyncio.wait_for(waiter, 1)  # woken by the change, not by a timer
        assert m.waiting == 0
        # The other configuration is ready; no replica of the request's is left: it ends.
        m2 = served(link("chat@2", config_id="c2"))
        with pytest.raises(EngineUnavailable, match="replaced by a changed configuration"):
            await m2.wait_ready(5, config_id="c1")
        # Every replica failed: at once, no retry.
        m3 = served(link("chat@0", L.FAILED), link("chat@1", L.FAILED))
        with pytest.raises(EngineUnavailable) as info:
            await m3.wait_ready(5)
        assert info.value.retry_after is None and "servectl restart chat" in str(info.value)

    asyncio.run(scenario())


def test_a_request_held_for_a_released_model_wakes_its_replicas():
    async def scenario():
        wakes: list[str] = []
        m = ServedModel("chat")
        for name in ("chat@0", "chat@1"):
            one = EngineLink(name, "/nonexistent", None, b"gw", wake=wakes.append)
            one.on_model_state("released", "", None)
            m.add(one)
        waiter = asyncio.ensure_future(m.wait_ready(5))
        await asyncio.sleep(0)
        assert wakes == ["chat@0", "chat@1"]
        waiter.cancel()

    asyncio.run(scenario())


# ---- rolling out a changed model ------------------------------------------------------------------

def test_a_rolled_out_group_takes_a_name_not_in_use():
    from manager.rollout import free_name

    assert free_name("chat", 0, 1, set()) == "chat"
    assert free_name("chat", 0, 1, {"chat"}) == "chat@1"  # not @0: its engine label would be chat's
    assert free_name("chat", 0, 1, {"chat", "chat@1"}) == "chat@2"
    assert free_name("chat", 1, 2, {"chat@0", "chat@1"}) == "chat@2"
    assert free_name("chat", 1, 2, {"chat@0", "chat@2"}) == "chat@1"


def test_a_new_group_is_started_beside_the_old_only_where_memory_allows():
    from manager.rollout import room_to_roll

    gib = 1 << 30
    assert room_to_roll(2 * gib, ("cpu",), None, False, {"cpu": 3 * gib}) is None
    assert room_to_roll(2 * gib, ("0", "1"), None, False, {"0": 3 * gib, "1": gib}) == \
        "device 1 has 1.0 GiB free, the new group needs 2.0 GiB"
    assert room_to_roll(None, ("cpu",), None, False, {"cpu": gib}) == "its footprint is not known"
    assert room_to_roll(gib, ("0",), None, False, {}) == "the free memory of device 0 is not known"
    # With a budget, the budget decides (what it counts: every loaded model, the old one included).
    assert room_to_roll(gib, ("cpu",), "cpu: 3 GiB of 4 GiB used", True, {"cpu": 100 * gib}) == \
        "cpu: 3 GiB of 4 GiB used"
    assert room_to_roll(gib, ("cpu",), None, True, {}) is None


def test_a_request_a_draining_engine_bounces_goes_elsewhere_and_marks_it_draining():
    async def scenario():
        one = link("chat@0")
        sink: asyncio.Queue = asyncio.Queue()
        from api_gateway.engine_requests import RequestStream
        from servectl.wire import engine as EP

        one.streams["r1"] = RequestStream("r1", sink, unfinished=2)
        one.outstanding = 2
        one.on_engine_message(EP.RequestError(incarnation="i", request_id="r1", message="model 'chat' is being "
                                              "stopped", status=503, draining=True), "i")
        rid, item = sink.get_nowait()
        assert rid == "r1" and isinstance(item, EngineUnavailable)  # gone: sent elsewhere, not an error
        assert (one.state, one.outstanding, one.streams) == (L.DRAINING, 0, {})

    asyncio.run(scenario())


def test_a_replica_released_for_idleness_is_woken_once_the_ready_ones_are_half_full():
    wakes: list[str] = []
    m = served(link("chat@0", seqs=4), link("chat@1", L.RELEASED))
    m.links["chat@1"].wake = wakes.append
    assert m.pick().model == "chat@0" and wakes == []  # an idle replica serves: nothing to wake
    m.links["chat@0"].outstanding = 1
    assert m.pick().model == "chat@0" and wakes == []  # room enough
    m.links["chat@0"].outstanding = 2
    assert m.pick().model == "chat@0" and wakes == ["chat@1"]


def test_the_budget_and_the_start_gate_count_replicas_one_by_one(tmp_path):
    from manager.budget import Budget
    from manager.start_gate import StartGate

    host = HostDouble(tmp_path)
    cfg = model(replicas=2)
    first, second = (EngineGroup(cfg, host, r) for r in range(2))
    groups = {g.name: g for g in (first, second)}
    budget = Budget(1, groups)  # max_loaded_models = 1
    first.state = GroupState.READY
    assert budget.short(first) is None  # alone under the cap
    assert budget.short(second) is not None  # its sibling counts as a loaded model
    first.state = GroupState.RELEASED  # released for idleness: holds nothing
    assert budget.short(second) is None
    gate = StartGate(accelerator=False)
    gate.groups = groups
    assert gate.labels(first) == gate.labels(second) == ("cpu",)  # one start at a time on a CPU host


def test_replica_environments_are_redacted_like_env():
    shown = C.redacted(C.Config(models=[model(replicas=2, env={"HF_TOKEN": "hf_secret"},
                                              replica_env=[{}, {"NCCL_SOCKET_IFNAME": "eth1"}])]))
    assert shown.models[0].env == {"HF_TOKEN": C.REDACTED}
    assert shown.models[0].replica_env == [{}, {"NCCL_SOCKET_IFNAME": C.REDACTED}]
