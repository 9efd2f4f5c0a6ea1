"""Admin keys and the management routes' pure parts: config, which key opens what, fingerprints,
the refusal budget, the audit record of an HTTP caller (no daemon, no vLLM)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from builders import config_error, config_from
from api_gateway.keys import Access, KeyRing, RefusalBudget, bearer_token, fingerprint
from manager.audit import Peer, audit_line, audit_record
from servectl import config as C
from servectl.wire import control as P
from servectl.wire import status as WS

pytestmark = pytest.mark.unit


# ---- config ---------------------------------------------------------------------------------

def test_admin_key_file_keys_join_the_listed_ones_once(tmp_path):
    keys = tmp_path / "admin.keys"
    keys.write_text("a1\na2 a1\n")
    cfg = config_from(tmp_path, f"[gateway]\nadmin_keys = ['a1']\nadmin_key_file = '{keys}'\n")
    assert cfg.gateway.admin_keys == ["a1", "a2"]
    assert cfg.gateway.api_keys == []


@pytest.mark.parametrize("key, says", [("", "empty"), ("   ", "empty"), ("a b", "without spaces"),
                                       ("caf\u00e9", "printable ASCII")])
def test_a_bad_admin_key_is_a_config_error_naming_it(tmp_path, key, says):
    msg = config_error(tmp_path, f"[gateway]\nadmin_keys = ['ok', {json.dumps(key)}]\n")
    assert "gateway.admin_keys[1]" in msg and says in msg, msg


def test_a_missing_admin_key_file_names_the_key_and_the_file(tmp_path):
    missing = tmp_path / "nope"
    msg = config_error(tmp_path, f"[gateway]\nadmin_key_file = '{missing}'\n")
    assert "gateway.admin_key_file" in msg and str(missing) in msg, msg


def test_admin_keys_are_redacted_like_api_keys(tmp_path):
    cfg = config_from(tmp_path, "[gateway]\napi_keys = ['sk-api']\nadmin_keys = ['sk-admin', 'sk-admin2']\n")
    shown = msgspec.json.encode(C.redacted(cfg)).decode()
    assert "sk-admin" not in shown and "sk-api" not in shown
    assert C.redacted(cfg).gateway.admin_keys == [C.REDACTED] * 2


# ---- which key opens what --------------------------------------------------------------------

@pytest.mark.parametrize("header, token", [
    (b"Bearer sk-1", b"sk-1"), (b"bearer sk-1", b"sk-1"), (b"BEARER sk-1", b"sk-1"), (b"Bearer  sk-1", b"sk-1"),
    (b"Basic sk-1", b""), (b"sk-1", b""), (b"", b""), (b"Bearer", b""), (b"Bearersk-1", b"")])
def test_the_bearer_scheme_is_case_insensitive_and_nothing_else_is_a_token(header, token):
    assert bearer_token(header) == token


def test_an_admin_key_opens_everything_an_api_key_only_the_api():
    ring = KeyRing(["sk-api"], ["sk-admin"])
    assert ring.access(b"sk-admin") is Access.ADMIN
    assert ring.access(b"sk-api") is Access.API
    assert ring.access(b"sk-nope") is Access.NONE
    assert ring.access(b"") is Access.NONE
    assert not ring.api_open and ring.admin_enabled


def test_without_admin_keys_the_routes_are_off_and_without_api_keys_the_api_is_open():
    assert not KeyRing(["sk-api"], []).admin_enabled
    assert KeyRing([], ["sk-admin"]).api_open
    assert KeyRing([], ["sk-admin"]).access(b"sk-admin") is Access.ADMIN


def test_a_key_in_both_lists_is_an_admin_key():
    assert KeyRing(["k"], ["k"]).access(b"k") is Access.ADMIN


@pytest.mark.deep
@given(st.binary(min_size=1, max_size=64))
def test_a_fingerprint_is_short_stable_and_never_the_key(key):
    fp = fingerprint(key)
    assert fp == fingerprint(key) and fp.startswith("sha256:") and len(fp) == 19
    assert key.hex() not in fp[7:] or len(key) < 6  # a short key's hex may occur by chance


def test_different_keys_have_different_fingerprints():
    assert fingerprint("sk-admin") != fingerprint("sk-admin2")
    assert fingerprint("sk-admin") == fingerprint(b"sk-admin")


# ---- the refusal budget ----------------------------------------------------------------------

def test_a_flood_of_refusals_is_reported_in_a_burst_then_summarised():
    budget = RefusalBudget(per_s=5.0, burst=3)
    reported = [budget.take(100.0) for _ in range(10)]
    assert reported[:3] == [0, 0, 0] and reported[3:] == [None] * 7
    # A fifth of a second later one token is back: the next report says how many were not sent.
    assert budget.take(100.2) == 7
    assert budget.take(100.2) is None
    assert budget.take(101.0) == 1


def test_a_quiet_caller_is_always_reported():
    budget = RefusalBudget(per_s=5.0, burst=3)
    assert all(budget.take(float(t)) == 0 for t in range(100))


# ---- the audit record ------------------------------------------------------------------------

HTTP = P.HttpCaller(key_id=fingerprint("sk-admin"), address="127.0.0.1", gateway="gateway:0",
                    route="POST /servectl/v1/models/m/restart")


def test_an_http_command_names_the_key_id_and_the_client_never_the_key():
    record = audit_record(0.0, Peer(1000, 1000, 4242), P.RestartRequest(model="m", http=HTTP), "accepted")
    assert record["via"] == "http" and record["admin_key"] == fingerprint("sk-admin")
    assert record["client"] == "127.0.0.1" and record["gateway"] == "gateway:0"
    assert record["route"] == "POST /servectl/v1/models/m/restart"
    assert record["command"] == "restart" and record["args"] == {"model": "m"}
    assert record["pid"] == 4242  # the gateway process, as the kernel saw it
    assert "sk-admin" not in audit_line(record)


def test_a_cli_command_stays_as_it_was():
    record = audit_record(0.0, Peer(0, 0, 7), P.UnloadModel(name="m"), "accepted")
    assert record["via"] == "control" and "admin_key" not in record and record["args"] == {"name": "m"}


def test_a_refusal_is_an_audit_record_of_its_own():
    msg = P.HttpRefused(http=P.HttpCaller(key_id=None, address="::1", gateway="gateway:0",
                                          route="GET /servectl/v1/models"), status=401, reason="no key")
    record = audit_record(0.0, Peer(0, 0, 7), msg, "denied")
    assert record["command"] == "http_refused" and record["admin_key"] is None and record["client"] == "::1"
    assert record["outcome"] == "denied"


def test_every_http_command_is_audited_as_changing():
    from manager.audit import CHANGING

    for cls in (P.RestartRequest, P.LoadConfigured, P.UnloadModel, P.SetFreezing):
        assert cls in CHANGING


# ---- the routes, on a real gateway against a scripted manager and engine ---------------------

class FakeManager:
    """The manager's control ROUTER, scripted: a status, an Ack per command; what arrived is kept."""

    def __init__(self, gw, state: str = "ready"):
        import zmq

        from servectl.paths import RuntimePaths

        self.sock = gw.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(RuntimePaths.ipc(gw.paths.control))
        self.state = state
        self.got: list = []
        self.task = None

    async def serve(self) -> None:
        while True:
            ident, body = await self.sock.recv_multipart()
            msg = P.control_in_decoder.decode(body)
            self.got.append(msg)
            if isinstance(msg, P.StatusRequest):
                reply = P.StatusReply(version=P.PROTOCOL_VERSION, instance="t", manager_pid=1, started_at=0.0,
                                      state="running", port=0, host="127.0.0.1", state_dir="/st", children=[],
                                      models=[WS.ModelStatus(name="m", state=self.state, frozen=False,
                                                            incarnation="inc1", memory_bytes=123, restarts=2,
                                                            devices="0")],
                                      unloaded=["spare"])
            elif isinstance(msg, P.HttpRefused):
                continue
            else:
                # A verb whose caller would not wait (wait_s = 0) is still under way when answered.
                reply = P.Ack(ok=not isinstance(msg, P.LoadConfigured), message=f"did {type(msg).__name__}",
                              done=getattr(msg, "wait_s", None) != 0)
            await self.sock.send_multipart([ident, P.encoder.encode(reply)])


def scenario_with_manager(body, **cfg):
    import asyncio

    from gateway_harness import run

    async def scenario(h):
        manager = FakeManager(h.gw)
        h.gw.manager.connect()
        h.gw.manager.component = "gateway:0"
        task = asyncio.get_running_loop().create_task(manager.serve())
        try:
            await body(h, manager)
        finally:
            task.cancel()
            manager.sock.close(linger=0)

    run(scenario, **cfg)


async def call(h, method: str, path: str, key: str | None = None, body: bytes | None = None):
    import aiohttp

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.request(method, h.url + path, data=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)


def test_without_admin_keys_every_route_is_a_404_and_nothing_reaches_the_manager():
    async def body(h, manager):
        for method, path in (("GET", "/servectl/v1/models"), ("POST", "/servectl/v1/models/m/restart")):
            status, answer = await call(h, method, path, key="sk-api")
            assert status == 404 and "no route" in answer["error"]["message"]
        assert manager.got == []

    scenario_with_manager(body, api_keys=["sk-api"])


def test_refusals_name_the_reason_and_reach_the_audit_log():
    import asyncio

    async def body(h, manager):
        assert (await call(h, "GET", "/servectl/v1/models"))[0] == 401
        status, answer = await call(h, "POST", "/servectl/v1/models/m/unload", key="sk-api")
        assert status == 403 and answer["error"]["code"] == "admin_key_required"
        for _ in range(500):  # the reports go in the background
            if len(manager.got) >= 2:
                break
            await asyncio.sleep(0.01)
        refusals = [m for m in manager.got if isinstance(m, P.HttpRefused)]
        assert [(r.status, r.http.key_id) for r in refusals] == [(401, None), (403, fingerprint("sk-api"))]
        assert refusals[1].http.route == "POST /servectl/v1/models/m/unload"
        assert not any(isinstance(m, P.UnloadModel) for m in manager.got)

    scenario_with_manager(body, api_keys=["sk-api"], admin_keys=["sk-admin"])


def test_the_list_joins_the_managers_status_with_the_engines_count():
    import asyncio

    async def body(h, manager):
        await h.ready()

        async def engine_answers():
            msg = await h.engine.recv()
            assert type(msg).__name__ == "Stats"
            await h.engine.stats_reply(unfinished=3)

        answering = asyncio.get_running_loop().create_task(engine_answers())
        status, answer = await call(h, "GET", "/servectl/v1/models", key="sk-admin")
        await answering
        assert status == 200, answer
        m, spare = answer["data"]
        assert m["name"] == "m" and m["state"] == "ready" and m["requests_running"] == 3
        assert m["memory_bytes"] == 123 and m["restarts"] == 2 and m["devices"] == "0"
        assert spare == {"name": "spare", "model": "spare", "state": "unloaded", "served": False}

    scenario_with_manager(body, admin_keys=["sk-admin"])


def test_a_command_carries_who_asked_and_the_answer_says_what_was_done():
    async def body(h, manager):
        await h.ready()  # a done restart's answer waits for this gateway to see the model serve
        status, answer = await call(h, "POST", "/servectl/v1/models/m/restart", key="sk-admin")
        assert status == 200 and answer == {"model": "m", "action": "restart", "done": True,
                                            "message": "did RestartRequest"}
        restart = next(m for m in manager.got if isinstance(m, P.RestartRequest))
        assert restart.model == "m" and restart.http.key_id == fingerprint("sk-admin")
        assert restart.http.address == "127.0.0.1" and restart.http.gateway == "gateway:0"
        status, answer = await call(h, "POST", "/servectl/v1/models/spare/load", key="sk-admin")
        assert status == 409 and answer["error"]["message"] == "did LoadConfigured"  # the manager said no
        status, answer = await call(h, "POST", "/servectl/v1/models/nope/unload", key="sk-admin")
        assert status == 404 and answer["error"]["code"] == "model_not_found"
        status, _ = await call(h, "POST", "/servectl/v1/models/m/freeze", key="sk-admin", body=b'{"enabled": 1}')
        assert status == 400
        status, answer = await call(h, "POST", "/servectl/v1/models/m/freeze", key="sk-admin",
                                    body=b'{"enabled": false}')
        assert status == 200 and answer["action"] == "thaw"
        freeze = next(m for m in manager.got if isinstance(m, P.SetFreezing))
        assert freeze.enabled is False and freeze.http.route == "POST /servectl/v1/models/m/freeze"

    scenario_with_manager(body, admin_keys=["sk-admin"])


def test_a_verb_waits_as_asked_and_says_whether_it_is_done():
    async def body(h, manager):
        await h.ready()
        status, answer = await call(h, "POST", "/servectl/v1/models/m/unload?wait=0", key="sk-admin")
        assert status == 202 and answer == {"model": "m", "action": "unload", "done": False,
                                            "message": "did UnloadModel"}
        status, answer = await call(h, "POST", "/servectl/v1/models/m/restart?wait=12.5", key="sk-admin")
        assert status == 200 and answer["done"] is True
        waits = [m.wait_s for m in manager.got if isinstance(m, (P.UnloadModel, P.RestartRequest))]
        assert waits == [0.0, 12.5]
        for bad in ("abc", "-1", "nan", "1e9", ""):
            status, answer = await call(h, "POST", f"/servectl/v1/models/m/unload?wait={bad}", key="sk-admin")
            assert status == 400 and answer["error"]["param"] == "wait", (bad, answer)
        assert len([m for m in manager.got if isinstance(m, P.UnloadModel)]) == 1  # the bad ones sent nothing

    scenario_with_manager(body, admin_keys=["sk-admin"])


def test_a_done_unload_is_answered_once_this_gateway_has_dropped_the_model():
    """The manager's answer can come before its `removed` event: the route waits for the event,
    so a request sent on the answer finds the model gone."""
    import asyncio

    async def body(h, manager):
        await h.ready()
        answer = asyncio.get_running_loop().create_task(call(h, "POST", "/servectl/v1/models/m/unload",
                                                             key="sk-admin"))
        for _ in range(500):
            if any(isinstance(m, P.UnloadModel) for m in manager.got):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not answer.done()  # the manager said done; this gateway still routes to the model
        h.model_state("removed", "inc1")
        status, reply = await asyncio.wait_for(answer, 5)
        assert status == 200 and reply["done"] is True and "m" not in h.gw.served

    scenario_with_manager(body, admin_keys=["sk-admin"])


def test_a_manager_that_does_not_answer_is_a_503_not_a_hang():
    async def body(h, manager):
        manager.sock.close(linger=0)  # nobody answers
        h.gw.admin.timeout_s = 0.2
        status, answer = await call(h, "GET", "/servectl/v1/models", key="sk-admin")
        assert status == 503 and "manager" in answer["error"]["message"]

    scenario_with_manager(body, admin_keys=["sk-admin"])
