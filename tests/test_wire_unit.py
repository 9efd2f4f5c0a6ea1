"""Every message that crosses a process boundary (servectl/wire), without a daemon.

Each message round-trips through the encoder and the decoder its receiver
uses; an unknown tag, a wrong type or a malformed frame is a msgspec error
(which receivers log and drop), never another exception. Component and
identity names are built and parsed by servectl/wire/spawn.py only.
"""

from __future__ import annotations

import inspect

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servectl.config import NAME_PATTERN, Config, GatewayConfig, ModelConfig, NamedKey, Overrides
from servectl.wire import control as CP
from servectl.wire import status as WS
from servectl.wire import tenancy as WT
from servectl.wire import engine as EP
from servectl.wire import spawn as SP
from servectl.wire import worker as WW

pytestmark = pytest.mark.unit

MODEL = ModelConfig(name="m.1", model="/models/m", tensor_parallel_size=2, devices="0,1",
                    engine_args={"max_num_seqs": 4, "enforce_eager": True}, env={"A": "1"}, crash_loop_count=3,
                    override_generation_config={"temperature": 0.5, "top_k": 40}, trust_request_chat_template=True,
                    **{k: v for k, v in dict(idle_release_s=5.0, idle_release="sleep", sleep_level=2, autostart=False,
                                             hold_timeout_s=900.0).items() if k in ModelConfig.__struct_fields__})
CHILD = WS.ChildStatus(component="worker:m.1:1", kind="worker", model="m.1", pid=41, ppid=40, state="ready",
                       since=1.5, started_at=1.25, restarts=2, last_exit="signal SIGKILL", last_log=["a", "b"],
                       exit_signal=9)

def known_fields(cls, **values):
    """A message with those of ``values`` that this version of it has (fields come and go)."""
    return cls(**{k: v for k, v in values.items() if k in cls.__struct_fields__})


HTTP = CP.HttpCaller(key_id="sha256:0123456789ab", address="127.0.0.1", gateway="gateway:0",
                     route="POST /servectl/v1/models/m.1/restart")

LORA = CP.LoraModule(name="sql", path="/a/sql", base_model_name="m.1")

# Every field differs from its default in some sample, so omit_defaults hides nothing.
DEVICE = known_fields(WS.DeviceBudget, label="0", budget_bytes=8 << 30, total_bytes=80 << 30, used_bytes=6 << 30,
                      models=["a", "b"])
EVICTION = known_fields(WS.LastEviction, model="a", needed_by="c", reason="evicted: model c needs room", at=5.0)
BUDGET = known_fields(WS.BudgetStatus, max_loaded_models=2, loaded=2, devices=[DEVICE], last_eviction=EVICTION)
SAMPLES: dict[type, list[msgspec.Struct]] = {
    # control: children and the CLI → manager
    CP.ChildReady: [CP.ChildReady(component="engine_core:m.1", pid=12, incarnation="abc", max_model_len=512,
                                  idle_release="sleep", device_memory_bytes=1 << 30, loras=[LORA],
                                  footprint_bytes=2 << 30, footprint_source="vLLM (accelerator)"),
                    CP.ChildReady(component="gateway:0", pid=13)],
    CP.GroupFrozen: [known_fields(CP.GroupFrozen, model="m.1", frozen=True, idle_since=12.5),
                     CP.GroupFrozen(model="m.1", frozen=False)],
    CP.GroupIdle: [CP.GroupIdle(model="m.1", incarnation="abc", idle_s=3.25)],
    CP.GroupReleased: [CP.GroupReleased(model="m.1", incarnation="abc", released=True, mode="sleep",
                                        device_memory_bytes=1 << 30),
                       CP.GroupReleased(model="m.1", incarnation="abc", released=False)],
    CP.WakeModel: [CP.WakeModel(model="m.1")],
    CP.GroupDrained: [CP.GroupDrained(model="m.1", incarnation="abc")],
    CP.GroupHung: [CP.GroupHung(model="m.1", incarnation="abc")],
    CP.EngineFailed: [CP.EngineFailed(model="m.1", incarnation="abc", reason="Cannot find any model weights")],
    CP.StepDeadlineChanged: [CP.StepDeadlineChanged(model="m.1", incarnation="abc", seconds=5.0)],
    CP.KeysApplied: [CP.KeysApplied(component="gateway:1", pid=77)],
    CP.StatusRequest: [CP.StatusRequest()],
    CP.LogTail: [CP.LogTail(component="gateway:0", after=7)],
    CP.LogLines: [CP.LogLines(component="gateway:0", lines=["a <b>"], written=8, known=False)],
    CP.WaitSettled: [CP.WaitSettled()],
    CP.StopRequest: [CP.StopRequest(), CP.StopRequest(timeout_s=2.5)],
    CP.RestartRequest: [CP.RestartRequest(), CP.RestartRequest(model="m.1", http=HTTP, wait_s=30.0)],
    CP.SetFreezing: [CP.SetFreezing(model="m.1", enabled=False), CP.SetFreezing(model="m.1", enabled=True, http=HTTP)],
    CP.ReloadRequest: [CP.ReloadRequest()],
    CP.LoadModel: [CP.LoadModel(model=MODEL), CP.LoadModel(model=MODEL, wait_s=0.0)],
    CP.UnloadModel: [CP.UnloadModel(name="m.1"), CP.UnloadModel(name="m.1", http=HTTP, wait_s=1.5)],
    CP.LoadConfigured: [CP.LoadConfigured(name="m.1"), CP.LoadConfigured(name="m.1", http=HTTP, wait_s=600.0)],
    CP.HttpRefused: [CP.HttpRefused(http=CP.HttpCaller(key_id=None, address="::1", gateway="gateway:0"), status=401,
                                    reason="no key"),
                     CP.HttpRefused(http=HTTP, status=403, reason="an API key", suppressed=3)],
    CP.LoadLora: [CP.LoadLora(lora=LORA), CP.LoadLora(lora=LORA, model="m.1", load_inplace=True, http=HTTP)],
    CP.UnloadLora: [CP.UnloadLora(name="sql"), CP.UnloadLora(name="sql", model="m.1", http=HTTP)],
    CP.LoraDone: [CP.LoraDone(model="m.1", incarnation="abc", call_id=3, ok=True, message="done", loras=[LORA]),
                  CP.LoraDone(model="m.1", incarnation="abc", call_id=4, ok=False, status=400, message="bad",
                              files=True)],
    CP.LoraReply: [CP.LoraReply(ok=True, status=200, message="ok", model="m.1", loras=[LORA]),
                   CP.LoraReply(ok=False, status=404, message="no")],
    CP.HttpCaller: [HTTP, CP.HttpCaller(key_id=None, address="", gateway="gateway:1")],
    # control: manager → clients
    WS.ChildStatus: [CHILD, WS.ChildStatus(component="gateway:0", kind="gateway", model=None, pid=None, ppid=None,
                                           state="backoff", since=0.0, started_at=None, restarts=0,
                                           last_exit="exit code 1", exit_code=1),
                      WS.ChildStatus(component="worker:big:1", kind="worker", model="big", pid=7, ppid=None,
                                     state="ready", since=0.0, started_at=None, restarts=0, last_exit=None,
                                     host="gpu-b", head="gpu-a")],
    WS.ModelStatus: [WS.ModelStatus(name="m.1", state="failed", frozen=True, incarnation="abc", reason="exit code 1"),
                     known_fields(WS.ModelStatus, name="m.1", state="asleep", frozen=False, incarnation="abc",
                                  release_after_s=3.0, release_mode="sleep", idle_since=1.5, released_since=2.5,
                                  memory_bytes=1 << 20, device_memory_bytes=1 << 30, hold_timeout_s=600.0,
                                  step_deadline_s=5.0, restarts=2, devices="0,1", start_s=9.5,
                                  config_id="fedcba9876543210", lora_enabled=True, loras=[LORA],
                                  footprint_bytes=3 << 30, footprint_measured=True, footprint_source="RSS",
                                  device_labels=["0", "1"], unfit="too large", standby_memory_bytes=1 << 28)],
    CP.StatusReply: [CP.StatusReply(version=CP.PROTOCOL_VERSION, instance="f00d", manager_pid=40, started_at=1.0,
                                    state="running", port=8123, host="::1", state_dir="/st", children=[CHILD],
                                    models=[WS.ModelStatus(name="m.1", state="ready", frozen=False,
                                                           incarnation="abc")], unloaded=["m.2"],
                                    budget=BUDGET)],
    WS.BudgetStatus: [WS.BudgetStatus(), BUDGET],
    WS.DeviceBudget: [DEVICE, WS.DeviceBudget(label="cpu", budget_bytes=None)],
    WS.LastEviction: [EVICTION],
    CP.Ack: [CP.Ack(ok=False, message="no model 'x'"), CP.Ack(ok=True), CP.Ack(ok=True, done=False)],
    # manager → whoever started it (JSON on the --report-fd pipe)
    CP.StartupFailed: [CP.StartupFailed(message="127.0.0.1:8000 is already in use", exit_code=1)],
    CP.ApiKeys: [CP.ApiKeys(keys=["sk-new", "sk-other"], admin_keys=["sk-admin"],
                            named=[NamedKey(name="team-a", key="sk-a", max_concurrent_requests=2, models=["m.1"])]),
                 CP.ApiKeys(keys=[])],
    # tenancy: gateways ⇄ manager (limits, usage)
    CP.Admit: [CP.Admit(ticket=7, key="team-a", model="m.1")],
    CP.Admitted: [CP.Admitted(ticket=7, ok=True, window=CP.Window(limit_tokens=100, remaining_tokens=40,
                                                                  reset_tokens_s=12.5)),
                  CP.Admitted(ticket=8, ok=False, limit="requests", retry_after_s=3.5, message="rate limit reached",
                              window=CP.Window(limit_requests=6, remaining_requests=0, reset_requests_s=3.5))],
    CP.Finished: [CP.Finished(key="team-a", model="m.1", ticket=7, prompt_tokens=5, completion_tokens=9, error=True),
                  CP.Finished(key="(none)", model="m.1", batch=True)],
    CP.UsageRequest: [CP.UsageRequest(since=1.5e9), CP.UsageRequest()],
    CP.UsageReply: [CP.UsageReply(since=60.0, until=125.5, rows=[CP.UsageRow(key="team-a", model="m.1", requests=2,
                                                                             prompt_tokens=5, completion_tokens=9,
                                                                             errors=1)])],
    CP.UsageRow: [CP.UsageRow(key="team-a", model="m.1", requests=2, prompt_tokens=5, completion_tokens=9, errors=1)],
    CP.Window: [CP.Window(limit_requests=6, remaining_requests=0, reset_requests_s=3.5, limit_tokens=100,
                          remaining_tokens=40, reset_tokens_s=12.5)],
    # control: manager → engine
    CP.AbortPeer: [CP.AbortPeer(peer="gw-0-123")],
    CP.FreezingControl: [CP.FreezingControl(enabled=True, grace_s=2.0), CP.FreezingControl(enabled=False)],
    CP.Drain: [CP.Drain()],
    CP.Release: [CP.Release(), CP.Release(mode="sleep", level=2)],
    CP.Wake: [CP.Wake()],
    CP.AddLora: [CP.AddLora(call_id=1, lora=LORA), CP.AddLora(call_id=2, lora=LORA, load_inplace=True)],
    CP.RemoveLora: [CP.RemoveLora(call_id=3, name="sql")],
    # events
    WS.Event: [WS.Event(component="model:m.1", kind="model", model="m.1", state="exited", pid=None, time=2.0,
                        incarnation="abc", detail="worker:m.1:0 signal SIGKILL", restarts=4, hung=True),
               known_fields(WS.Event, component="model:m.1", kind="model", model="m.1", state="released", pid=None,
                            time=3.0, hold_timeout_s=300.0, start_s=12.5, config_id="0123456789abcdef",
                            loras=[LORA], unfit=True),
               known_fields(WS.Event, component="engine_core:m.1", kind="deadline", model="m.1", state="armed",
                            pid=12, time=4.0, incarnation="abc", detail="5.000", step_deadline_s=5.0),
               WS.Event(component="host:gpu-b", kind="host", model=None, state="exited", pid=None, time=5.0,
                        detail="host gpu-b left: the link failed", host="gpu-b")],
    # engine: gateway → engine
    EP.Hello: [EP.Hello(version=EP.PROTOCOL_VERSION)],
    EP.ReplayedDelta: [EP.ReplayedDelta("ab", [4, 5]), EP.ReplayedDelta("", [])],
    EP.Resume: [EP.Resume(index=1, token_ids=[4, 5], text_chars=3),
                EP.Resume(token_ids=[4, 5], text_chars=2, deltas=[EP.ReplayedDelta("a", [4]),
                                                                  EP.ReplayedDelta("b", [5])])],
    EP.Generate: [known_fields(EP.Generate, request_id="r0", kind="completion", body={"prompt": "x"},
                               resume=EP.Resume(index=1, token_ids=[4])),
                  EP.Generate(request_id="r1", kind="completion",
                              body={"prompt": "def ", "temperature": 0.5, "n": 2, "echo": True}),
                  EP.Generate(request_id="r2", kind="completion", body={"prompt": [1, 2, 3]}),
                  EP.Generate(request_id="r5", kind="messages", body={"messages": []}, priority=3000, tenant="team-a"),
                  EP.Generate(request_id="r4", kind="responses", body={"input": "hi", "stream": True},
                              answer_id="0123456789abcdef",
                              trace_parent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
                  EP.Generate(request_id="r3", kind="chat", body={"messages": [{"role": "user", "content": "hi"}],
                                                                  "structured_outputs": {"choice": ["a", "b"]}})],
    EP.Abort: [EP.Abort(request_ids=["r1", "r2"])],
    EP.Stats: [EP.Stats(), EP.Stats(request_ids=["r1", "r2"])],
    EP.Tokenizer: [EP.Tokenizer(request_id="t1", kind="tokenize", body={"prompt": "x"}),
                   EP.Tokenizer(request_id="t2", kind="tokenizer_info")],
    EP.MetricsRequest: [EP.MetricsRequest()],
    # engine: engine → gateway
    EP.HelloReply: [EP.HelloReply(version=1, incarnation="abc", model="m.1", max_model_len=512, max_num_seqs=8,
                                  rejected_frames=3, tasks=["embed", "token_embed"],
                                  kv_events={"endpoint": "tcp://127.0.0.1:5557", "topic": ""}, kv_events_rank=2,
                                  max_prompt_chars=18944,
                                  trace_parent="00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01")],
    EP.PromptInfo: [EP.PromptInfo(tokens=3, token_ids=[0, 5, 6], echo_text="def ",
                                  echo_logprobs=[["<s>", None, None, None], ["def", -1.0, [["def", -1.0]], None]],
                                  prompt_logprobs=[None, {"5": {"logprob": -1.0, "rank": 1, "decoded_token": "def"}}],
                                  role="assistant", prompt_text="<t>def ", parsed=True, reasoning_usage=True,
                                  metadata_hidden=True, constrained=True)],
    EP.Delta: [EP.Delta(request_id="r1", index=1, text="x", token_ids=[5, 6], finish_reason="stop", stop_reason=7,
                        logprobs=[["x", -0.5, [["x", -0.5], ["y", -1.5]], [120]]],
                        prompt=EP.PromptInfo(tokens=3)),
               EP.Delta(request_id="r2", stop_reason="\n", reasoning_tokens=4,
                        message={"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}),
               EP.Delta(request_id="r3", token_ids=[7], text="hi",
                        api_output='event: response.output_text.delta\ndata: {"delta":"hi"}\n\n')],
    EP.StepOutput: [EP.StepOutput(incarnation="abc", deltas=[EP.Delta(request_id="r1", text="a"),
                                                             EP.Delta(request_id="r2", index=1, token_ids=[9])]),
                    EP.StepOutput(incarnation="abc", deltas=[])],
    EP.RequestError: [EP.RequestError(incarnation="abc", request_id="r1", message="too long", status=503,
                                      param="max_tokens"),
                      known_fields(EP.RequestError, incarnation="abc", request_id="r2", message="released",
                                   status=503, released=True),
                      known_fields(EP.RequestError, incarnation="abc", request_id="r3", message="draining",
                                   status=503, draining=True)],
    EP.TokenizerReply: [EP.TokenizerReply(incarnation="abc", request_id="t1", body={"count": 1, "tokens": [5]})],
    EP.MetricsReply: [EP.MetricsReply(incarnation="abc", text="vllm:num_requests_running{model_name=\"m.1\"} 1.0\n")],
    EP.StatsReply: [known_fields(EP.StatsReply, incarnation="abc", unfinished=2, rejected_frames=1,
                                 overlapped_steps=5, token_replies=7, signed_replies=3, missing=["r3"],
                                 last_worked_at=1.5, steps_one_deep=4, steps_sat_out=2)],
    # spawn: what the manager hands a child at exec (JSON on argv, or over the standby's channel)
    SP.EngineSpec: [SP.EngineSpec(model=MODEL, runtime_dir="/rt", incarnation="abc", freezing=False,
                                  freeze_grace_s=1.5, worker_reply_timeout_s=30.0),
                   known_fields(SP.EngineSpec, model=MODEL, runtime_dir="/rt", incarnation="abc", freezing=True,
                                freeze_grace_s=1.0, worker_reply_timeout_s=3.0, idle_release_s=2.5,
                                idle_release="sleep", sleep_level=2, step_deadline_multiple=10.0,
                                step_deadline_floor_s=2.0, max_body_bytes=1 << 20, loras=[LORA], group="m@1",
                                replica=1, events_slot=2, init_methods=["tcp://10.0.0.1:29500?host=a"] * 2,
                                remote_ranks=[1], local_ranks=[0, 0], dead_after_s=3.0)],
    SP.GatewaySpec: [SP.GatewaySpec(index=1, runtime_dir="/rt", instance="f00d",
                                    gateway=GatewayConfig(port=0, processes=2, api_keys=["k"]), models=["a", "b"],
                                    drain_timeout_s=5.0, ui_secret="ab" * 32, state_dir="/var/lib/servectl")],
    SP.ManagerSpec: [SP.ManagerSpec(config=Config(gateway=GatewayConfig(api_keys=["k"]), models=[MODEL]),
                                    config_path="/etc/servectl/servectl.toml",
                                    overrides=Overrides(port=0, engine_args={"x": 1})),
                     SP.ManagerSpec(config=Config())],
    SP.Role: [SP.Role(module="engine_core", argv=["--key-fd", "@fd0", "--spec-fd", "@fd1"]),
              SP.Role(module="engine_core.workers.worker", argv=[])],
    # worker → engine: a step's reply of sampled tokens only (untagged: the only unsigned message)
    WW.TokensReply: [WW.TokensReply(call_id=12, req_ids=["cmpl-a-0", "cmpl-b-0"], sampled_token_ids=[[5], [7, 8]],
                                    empty_dicts=["num_nans_in_logits"]),
                     WW.TokensReply(call_id=13, req_ids=[], sampled_token_ids=[])],
}

# Which decoder each message's receiver uses (None: decoded by type where it is embedded).
UNIONS = {
    "ControlIn": (CP.ControlIn, CP.control_in_decoder, CP.encoder),
    "ControlOut": (CP.ControlOut, CP.control_out_decoder, CP.encoder),
    "ToEngine": (CP.ToEngine, CP.to_engine_decoder, CP.encoder),
    "FromGateway": (EP.FromGateway, EP.from_gateway_decoder, EP.encoder),
    "ToGateway": (EP.ToGateway, EP.to_gateway_decoder, EP.encoder),
}


def structs_of(module) -> set[type]:
    return {obj for name, obj in vars(module).items() if inspect.isclass(obj) and issubclass(obj, msgspec.Struct)
            and obj.__module__ == module.__name__ and not name.startswith("_")}


def union_members(union) -> set[type]:
    return set(union.__args__)


def tag_of(cls: type) -> str | None:
    return cls.__struct_config__.tag


def test_every_message_has_samples():
    defined = structs_of(CP) | structs_of(EP) | structs_of(SP) | structs_of(WS) | structs_of(WT) | structs_of(WW)
    assert defined == set(SAMPLES), f"add round-trip samples for {sorted(c.__name__ for c in defined - set(SAMPLES))}"
    for cls, samples in SAMPLES.items():
        assert samples and all(type(s) is cls for s in samples), cls


def test_samples_set_every_field_to_something_else_than_its_default():
    for cls, samples in SAMPLES.items():
        info = msgspec.inspect.type_info(cls)
        for field in info.fields:
            if field.required:
                continue
            default = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
            assert any(getattr(s, field.name) != default for s in samples), \
                f"no sample of {cls.__name__} sets {field.name}"


def test_every_tagged_message_belongs_to_exactly_one_direction():
    tagged = {cls for cls in SAMPLES if tag_of(cls) is not None}
    members = [union_members(u) for u, _, _ in UNIONS.values()]
    assert set().union(*members) == tagged
    assert sum(len(m) for m in members) == len(tagged)  # no message in two unions


def test_tags_are_unique_per_module():
    for module in (CP, EP):
        tags = [tag_of(c) for c in structs_of(module) if tag_of(c) is not None]
        assert len(tags) == len(set(tags)), module.__name__


@pytest.mark.parametrize("union", sorted(UNIONS))
def test_tagged_messages_round_trip_through_their_receivers_decoder(union):
    members, decoder, encoder = UNIONS[union]
    for cls in union_members(members):
        for msg in SAMPLES[cls]:
            data = encoder.encode(msg)
            assert decoder.decode(data) == msg, msg
            assert msgspec.msgpack.decode(data)["type"] == tag_of(cls)


@pytest.mark.parametrize("cls", [WS.ChildStatus, WS.ModelStatus, WS.Event, EP.Delta, EP.Resume, WW.TokensReply])
def test_untagged_messages_round_trip(cls):
    for msg in SAMPLES[cls]:
        data = msgspec.msgpack.encode(msg)
        assert msgspec.msgpack.decode(data, type=cls) == msg
    if cls is WW.TokensReply:
        assert all(WW.decoder.decode(WW.encoder.encode(m)) == m for m in SAMPLES[cls])
    if cls is WS.Event:
        assert all(WS.event_decoder.decode(CP.encoder.encode(m)) == m for m in SAMPLES[cls])


def test_a_startup_failure_round_trips_as_one_json_line():
    for msg in SAMPLES[CP.StartupFailed]:
        data = msgspec.json.encode(msg)
        assert b"\n" not in data and CP.startup_failed_decoder.decode(data) == msg
    assert CP.startup_failed_decoder.decode(b'{"message": "x"}').exit_code == 2  # a usage/config error


@pytest.mark.parametrize("cls", [SP.ManagerSpec, SP.EngineSpec, SP.GatewaySpec, SP.Role])
def test_spawn_specs_round_trip_as_json(cls):
    for msg in SAMPLES[cls]:
        text = msgspec.json.encode(msg).decode()  # what goes in the spec memfd or over the channel
        assert msgspec.json.decode(text, type=cls) == msg


@pytest.mark.parametrize("cls", [SP.ManagerSpec, SP.EngineSpec, SP.GatewaySpec])
def test_specs_travel_in_a_sealed_memfd(cls):
    """Specs carry API keys and model envs: in a memfd a child inherits, never on an argv."""
    import errno
    import os

    for msg in SAMPLES[cls]:
        fd = SP.spec_fd(msg)
        os.lseek(fd, 3, os.SEEK_SET)  # a shared offset moved by someone else does not matter
        with pytest.raises(OSError) as exc:
            os.pwrite(fd, b"{}", 0)  # sealed: nobody changes what the child reads
        assert exc.value.errno == errno.EPERM
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        assert SP.read_spec_fd(fd, cls) == msg
        with pytest.raises(OSError):
            os.fstat(fd)  # read_spec_fd closed it


def test_a_role_names_only_the_two_modules_a_standby_can_become():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"module": "api_gateway", "argv": []}', type=SP.Role)


def test_delta_travels_as_an_array_in_field_order():
    """One StepOutput per step carries every request's Delta: no field names on the wire."""
    encoded = msgspec.msgpack.decode(EP.encoder.encode(EP.Delta(request_id="r", text="x")))
    assert encoded[:4] == ["r", 0, "x", []] and len(encoded) == len(EP.Delta.__struct_fields__)


def test_protocol_versions():
    # 2: Generate carries vLLM request fields; 3: a parsed chat's deltas carry vLLM's JSON (Delta.message)
    assert CP.PROTOCOL_VERSION == 1 and EP.PROTOCOL_VERSION == 4


# ---- what a receiver must survive ------------------------------------------------------

DECODERS = [CP.control_in_decoder, CP.control_out_decoder, CP.to_engine_decoder, WS.event_decoder,
            EP.from_gateway_decoder, EP.to_gateway_decoder]


@pytest.mark.parametrize("decoder", DECODERS, ids=lambda d: repr(d.type))
@pytest.mark.parametrize("frame,error", [
    (b"", msgspec.DecodeError),  # truncated
    (b"\xc1", msgspec.DecodeError),  # never-used msgpack opcode
    (b"\x93nonsense", msgspec.DecodeError),
    (msgspec.msgpack.encode({"type": "no_such_message"}), msgspec.ValidationError),
    (msgspec.msgpack.encode({"no": "tag"}), msgspec.ValidationError),
    (msgspec.msgpack.encode([1, 2, 3]), msgspec.ValidationError),
    (msgspec.msgpack.encode("a string"), msgspec.ValidationError),
])
def test_malformed_frames_are_msgspec_errors(decoder, frame, error):
    with pytest.raises(error):
        decoder.decode(frame)


@pytest.mark.parametrize("decoder,frame", [
    (CP.control_in_decoder, {"type": "child_ready", "component": "x"}),  # missing pid
    (CP.control_in_decoder, {"type": "child_ready", "component": "x", "pid": "12"}),
    (CP.control_in_decoder, {"type": "set_freezing", "model": "m", "enabled": "yes"}),
    (CP.control_in_decoder, {"type": "load", "model": {"name": "a b", "model": "/x"}}),  # bad name
    (CP.control_in_decoder, {"type": "load", "model": {"name": "a", "model": "/x", "bogus": 1}}),
    (CP.to_engine_decoder, {"type": "freezing_control", "enabled": True, "grace_s": "1"}),
    (EP.from_gateway_decoder, {"type": "generate", "request_id": 5}),
    (EP.from_gateway_decoder, {"type": "abort", "request_ids": "r1"}),
    (EP.to_gateway_decoder, {"type": "step", "incarnation": "a", "deltas": [{"request_id": "r"}]}),  # not an array
])
def test_wrong_types_are_validation_errors(decoder, frame):
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode(frame))


@pytest.mark.parametrize("decoder,msg", [
    (CP.control_in_decoder, CP.StatusReply(version=1, instance="i", manager_pid=1, started_at=0, state="running",
                                           port=1, host="h", state_dir="/s", children=[], models=[])),
    (CP.control_out_decoder, CP.StatusRequest()),
    (CP.to_engine_decoder, CP.StopRequest()),
    (EP.from_gateway_decoder, EP.HelloReply(version=1, incarnation="a", model="m", max_model_len=1)),
    (EP.to_gateway_decoder, EP.Generate(request_id="r", kind="chat", body={})),
])
def test_a_message_sent_the_wrong_way_is_refused(decoder, msg):
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode(msg))


@pytest.mark.deep
@settings(deadline=None, derandomize=True)
@given(frame=st.binary(max_size=64) | st.builds(msgspec.msgpack.encode, st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(["type", "model", "pid", "x"]) | st.text(
        max_size=4), c, max_size=4), max_leaves=10)))
def test_arbitrary_frames_never_raise_anything_but_msgspec_errors(frame):
    for decoder in DECODERS:
        try:
            decoder.decode(frame)
        except msgspec.DecodeError:  # ValidationError is a DecodeError
            pass


# ---- names -----------------------------------------------------------------------------------

model_names = st.from_regex(NAME_PATTERN, fullmatch=True)
numbers = st.integers(min_value=0, max_value=10**6)


@pytest.mark.deep
@settings(deadline=None, derandomize=True)
@given(model=model_names, n=numbers)
def test_built_names_parse_back_to_their_parts(model, n):
    C = SP.ComponentName
    engine, worker = SP.engine_component(model), SP.worker_component(model, n)
    assert SP.parse_component(engine) == C(SP.ENGINE, model)
    assert SP.parse_component(worker) == C(SP.WORKER, model, n)
    assert SP.parse_component(SP.gateway_component(n)) == C(SP.GATEWAY, None, n)
    assert SP.parse_component(SP.model_component(model)) == C(SP.MODEL, model)
    assert SP.parse_component(SP.standby_component(engine)) == C(SP.STANDBY, model, None, engine)
    assert SP.parse_component(SP.standby_component(worker)) == C(SP.STANDBY, model, n, worker)


def test_names_are_what_status_logs_and_sockets_show():
    assert SP.engine_component("a") == "engine_core:a"
    assert SP.worker_component("a", 1) == "worker:a:1"
    assert SP.gateway_component(0) == "gateway:0"
    assert SP.standby_component("worker:a:1") == "standby:worker:a:1"
    assert SP.model_component("a") == "model:a"
    assert SP.engine_identity("a") == b"engine:a"
    assert SP.gateway_identity(2, 345) == "gw-2-345"
    assert SP.log_file_name("standby:worker:a:1") == "standby-worker-a-1.log"


@pytest.mark.parametrize("name", [
    "", "manager", ":", "engine_core", "engine_core:", "model:", "worker", "worker:", "worker:a", "worker:a:",
    "worker::0", "worker:a:x", "worker:a:-1", "worker:a: 1", "gateway", "gateway:", "gateway:x", "gateway:-1",
    "gateway: 1", "gateway:1.0", "standby", "standby:", "standby:nonsense", "standby:worker:a", "standby:gateway:x",
    "nonsense:a", "Engine_core:a",
    # socket identities are not component names
    "engine:a", "gw-0-123",
])
def test_names_that_are_not_ours_parse_to_none(name):
    assert SP.parse_component(name) is None


@pytest.mark.parametrize("name", [
    pytest.param("gateway:\u00b2", id="superscript-two"),
    pytest.param("worker:a:\u0663", id="arabic-indic-digit"),
    pytest.param("gateway:01", id="leading-zero"),
    pytest.param("engine_core:a:b", id="colon-in-model"),
    pytest.param("worker:a:b:0", id="colon-in-worker-model"),
    pytest.param("engine_core:a b", id="space-in-model"),
    pytest.param("standby:gateway:0", id="standby-of-a-gateway"),
    pytest.param("standby:model:a", id="standby-of-a-model"),
    pytest.param("standby:standby:engine_core:a", id="standby-of-a-standby"),
])
def test_names_no_builder_makes_parse_to_none(name):
    assert SP.parse_component(name) is None


def rebuild(parts: SP.ComponentName) -> str:
    return {
        SP.ENGINE: lambda: SP.engine_component(parts.model),
        SP.WORKER: lambda: SP.worker_component(parts.model, parts.index),
        SP.GATEWAY: lambda: SP.gateway_component(parts.index),
        SP.MODEL: lambda: SP.model_component(parts.model),
        SP.STANDBY: lambda: SP.standby_component(parts.member),
    }[parts.kind]()


@pytest.mark.deep
@settings(deadline=None, derandomize=True)
@given(name=st.text(max_size=24) | st.text(alphabet=st.sampled_from("ab:019_-. \n\u00b2\u0663"), max_size=24)
       | st.builds(lambda k, rest: f"{k}:{rest}", st.sampled_from(["engine_core", "worker", "gateway", "standby",
                                                                      "model", "standby:engine_core",
                                                                      "standby:worker"]), st.text(max_size=16)))
def test_any_string_parses_to_none_or_to_the_parts_that_build_it(name):
    parts = SP.parse_component(name)  # never raises
    assert parts is None or rebuild(parts) == name, parts


# ---- descriptor references ------------------------------------------------------------

def test_fd_references_are_resolved_only_where_a_whole_argument_names_them():
    argv = ["--spec", '{"env": {"X": "@fd0"}}', "--key-fd", SP.fd_ref(0),
            "--worker-pidfds", f"{SP.fd_ref(1)},{SP.fd_ref(2)}", "--none", "", "--text", "@fdx", "@fd1,x"]
    assert SP.resolve_fd_args(argv, [7, 11, 12]) == [
        "--spec", '{"env": {"X": "@fd0"}}', "--key-fd", "7", "--worker-pidfds", "11,12", "--none", "", "--text",
        "@fdx", "@fd1,x"]
