"""Named keys, their limits, usage and fair share: the pure parts (no daemon, no vLLM).

The config's [[gateway.keys]]; which key a token is (``KeyRing.identify``); the manager's
limits across gateways (``KeyLimits``) and its usage ledger on disk (``UsageLedger``: a
restart, a crash between its snapshot and removing the logs, a line cut mid-write); the
fair share's priorities; OpenAI's rate-limit headers; the /metrics counters' text.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from builders import config_error, config_from
from api_gateway.fair_share import SCALE, FairShare
from api_gateway.keys import OPEN, Access, KeyRing, fingerprint
from api_gateway.metrics import key_usage_exposition
from api_gateway.tenancy import rate_headers, seconds
from manager.limits import WINDOW_S, KeyLimits
from manager.usage import SNAPSHOT, UsageLedger
from servectl import config as C
from servectl.wire import control as P

pytestmark = pytest.mark.unit

GW0, GW1 = b"gw-0-100", b"gw-1-101"


def named(name: str, **kw) -> C.NamedKey:
    return C.NamedKey(name=name, key=f"sk-{name}-0123456789", **kw)


# ---- config -----------------------------------------------------------------------------------

def test_named_keys_are_read_with_their_limits_and_a_key_file(tmp_path):
    (tmp_path / "b.key").write_text("sk-from-file-0123\n")
    cfg = config_from(tmp_path, "[gateway]\napi_keys = ['sk-plain-0123']\n"
                      "[[gateway.keys]]\nname = 'team-a'\nkey = 'sk-a-0123'\nmax_concurrent_requests = 2\n"
                      "requests_per_minute = 60\ntokens_per_minute = 1000\nweight = 2.5\nmodels = ['default']\n"
                      f"[[gateway.keys]]\nname = 'team-b'\nkey_file = '{tmp_path / 'b.key'}'\n")
    a, b = cfg.gateway.keys
    assert (a.name, a.key, a.max_concurrent_requests, a.requests_per_minute, a.tokens_per_minute, a.weight,
            a.models) == ("team-a", "sk-a-0123", 2, 60, 1000, 2.5, ["default"])
    assert a.limited and not b.limited
    assert (b.key, b.key_file, b.models, b.weight) == ("sk-from-file-0123", None, None, 1.0)
    shown = C.redacted(cfg).gateway.keys
    assert [k.key for k in shown] == [C.REDACTED, C.REDACTED] and shown[0].name == "team-a"


@pytest.mark.parametrize("entries, says", [
    ("name = 'a'\nkey = 'sk-a-0123'\n[[gateway.keys]]\nname = 'a'\nkey = 'sk-b-0123'", "the name is used twice"),
    ("name = 'a'", "give `key` or `key_file`"),
    ("name = 'a'\nkey = 'sk-a-0123'\nkey_file = '/x'", "give `key` or `key_file`"),
    ("name = 'a'\nkey_file = '/nonexistent/key'", "cannot read /nonexistent/key"),
    ("name = 'a'\nkey = 'sk plain'", "printable ASCII without spaces"),
    ("name = 'a'\nkey = 'sk-plain-0123'", "the same key is already configured"),
    ("name = 'a'\nkey = 'sk-a-0123'\nmodels = ['nope']", "'nope' is not a model served here"),
    ("name = 'a b'\nkey = 'sk-a-0123'", "gateway.keys"),
    ("name = 'a'\nkey = 'sk-a-0123'\nweight = 0", "gateway.keys"),
    ("name = 'a'\nkey = 'sk-a-0123'\nrequests_per_minute = 0", "gateway.keys"),
])
def test_bad_named_keys_are_refused_naming_the_entry(tmp_path, entries, says):
    error = config_error(tmp_path, f"[gateway]\napi_keys = ['sk-plain-0123']\n[[gateway.keys]]\n{entries}\n")
    assert says in error and "gateway.keys" in error


# ---- which key a token is -------------------------------------------------------------------------

def test_a_token_is_its_named_key_an_unnamed_keys_fingerprint_or_nothing():
    ring = KeyRing(["sk-plain"], ["sk-admin"], [named("team-a")])
    assert not ring.api_open
    a = ring.identify(b"sk-team-a-0123456789")
    assert (a.access, a.label, a.named.name) == (Access.API, "team-a", "team-a")
    plain = ring.identify(b"sk-plain")
    assert (plain.access, plain.label, plain.named) == (Access.API, fingerprint("sk-plain"), None)
    assert ring.identify(b"sk-admin").access is Access.ADMIN
    assert ring.identify(b"") is None and ring.identify(b"sk-other") is None
    assert ring.access(b"sk-team-a-0123456789") is Access.API  # the status page and admin checks see it
    assert ring.access_of(fingerprint("sk-team-a-0123456789")) is Access.API
    assert KeyRing([], [], [named("x")]).api_open is False  # a named key alone closes the API
    assert KeyRing([], ["sk-admin"]).api_open and OPEN.label == "(none)"


# ---- limits across gateways ----------------------------------------------------------------------

def test_a_concurrency_limit_holds_across_gateways_and_a_dead_gateways_slots_are_freed():
    limits = KeyLimits([named("a", max_concurrent_requests=2)])
    assert limits.admit("a", (GW0, 1), 0.0).ok
    assert limits.admit("a", (GW1, 1), 0.0).ok
    refused = limits.admit("a", (GW0, 2), 0.0)
    assert not refused.ok and refused.limit == "concurrency" and "max_concurrent_requests = 2" in refused.message
    limits.finish("a", (GW1, 1), 10, 1.0)
    assert limits.admit("a", (GW1, 2), 1.0).ok  # the finished one's slot
    assert limits.gateway_gone(GW0) == 1  # gw-0 died holding one
    assert limits.admit("a", (GW1, 3), 1.0).ok
    assert limits.admit("unknown", (GW0, 9), 1.0).ok  # not a named key (any more): nothing holds it


def test_requests_per_minute_refuses_until_the_oldest_leaves_the_window():
    limits = KeyLimits([named("a", requests_per_minute=3)])
    for t in (0.0, 10.0, 20.0):
        ok = limits.admit("a", (GW0, int(t)), t)
        assert ok.ok
        limits.finish("a", (GW0, int(t)), 5, t)
    assert ok.window.limit_requests == 3 and ok.window.remaining_requests == 0
    refused = limits.admit("a", (GW1, 99), 30.0)
    assert not refused.ok and refused.limit == "requests" and refused.retry_after_s == pytest.approx(30.0)
    assert limits.admit("a", (GW1, 100), WINDOW_S + 0.5).ok  # the first left the window


def test_tokens_per_minute_counts_finished_tokens_and_says_when_enough_left():
    limits = KeyLimits([named("a", tokens_per_minute=100)])
    assert limits.admit("a", (GW0, 1), 0.0).ok
    limits.finish("a", (GW0, 1), 70, 0.0)
    second = limits.admit("a", (GW0, 2), 5.0)
    assert second.ok and second.window.remaining_tokens == 30 and second.window.limit_tokens == 100
    limits.finish("a", (GW0, 2), 50, 10.0)  # a request may take the window past the limit
    refused = limits.admit("a", (GW1, 3), 20.0)
    assert not refused.ok and refused.limit == "tokens" and refused.window.remaining_tokens == 0
    assert refused.retry_after_s == pytest.approx(40.0)  # the 70 leave at 60 s: 50 < 100
    assert limits.admit("a", (GW1, 4), 60.5).ok


def test_a_reload_keeps_the_counts_of_the_names_it_keeps():
    limits = KeyLimits([named("a", max_concurrent_requests=1), named("b", max_concurrent_requests=1)])
    assert limits.admit("a", (GW0, 1), 0.0).ok
    limits.set_keys([named("a", max_concurrent_requests=1)])
    assert not limits.admit("a", (GW0, 2), 0.0).ok  # still holds its one
    assert limits.admit("b", (GW0, 3), 0.0).ok  # b is no longer limited


@given(st.lists(st.tuples(st.sampled_from(["admit", "finish", "gone"]), st.integers(0, 1), st.integers(1, 6)),
                max_size=60))
def test_concurrency_in_flight_never_exceeds_the_limit(steps):
    limits = KeyLimits([named("a", max_concurrent_requests=3)])
    held: set = set()
    for t, (what, gw, ticket) in enumerate(steps):
        ident = (GW0, GW1)[gw]
        if what == "admit" and (ident, ticket) not in held:
            if limits.admit("a", (ident, ticket), float(t)).ok:
                held.add((ident, ticket))
        elif what == "finish":
            limits.finish("a", (ident, ticket), 1, float(t))
            held.discard((ident, ticket))
        elif what == "gone":
            limits.gateway_gone(ident)
            held = {h for h in held if h[0] != ident}
        assert len(held) <= 3 and limits.state["a"].in_flight == held


# ---- the usage ledger ------------------------------------------------------------------------------

def test_usage_survives_a_restart_and_a_query_since_a_minute(tmp_path):
    ledger = UsageLedger(tmp_path)
    ledger.open(1000.0)
    ledger.add("a", "m", 5, 7, False, 1000.0)
    ledger.add("a", "m", 1, 0, True, 1130.0)
    ledger.add("b", "m", 2, 3, False, 1130.0)
    ledger.close()  # (a SIGKILL leaves the same files: each line was written at once)
    again = UsageLedger(tmp_path)
    again.open(2000.0)
    rows = {(r.key, r.model): r for r in again.rows(None)}
    assert (rows["a", "m"].requests, rows["a", "m"].prompt_tokens, rows["a", "m"].completion_tokens,
            rows["a", "m"].errors) == (2, 6, 7, 1)
    since = {(r.key, r.model): r.requests for r in again.rows(1125.0)}  # from the minute of 1120
    assert since == {("a", "m"): 1, ("b", "m"): 1}
    assert again.rows(5000.0) == []
    again.close()


def test_a_crash_after_the_snapshot_never_counts_a_log_twice(tmp_path):
    ledger = UsageLedger(tmp_path)
    ledger.open(0.0)
    ledger.add("a", "m", 1, 1, False, 10.0)
    ledger.close()
    kept = (tmp_path / "1.log").read_bytes()
    second = UsageLedger(tmp_path)
    second.open(20.0)  # snapshot absorbs 1.log, removes it
    second.close()
    (tmp_path / "1.log").write_bytes(kept)  # as if the crash came between the rename and the unlink
    (tmp_path / "2.log").write_bytes(b'[0,"a","m",1,2,3,0]\n[0,"a","m",1,')  # and a line cut mid-write
    third = UsageLedger(tmp_path)
    third.open(30.0)
    (row,) = third.rows(None)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 3, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3.log", SNAPSHOT]
    assert json.loads((tmp_path / SNAPSHOT).read_text())["absorbed"] == ["1.log", "2.log"]
    third.close()


def test_old_minutes_become_hours_and_keep_their_counts(tmp_path):
    ledger = UsageLedger(tmp_path)
    ledger.open(0.0)
    for minute in range(3):
        ledger.add("a", "m", 1, 1, False, 3600.0 + 60 * minute)
    ledger.close()
    later = UsageLedger(tmp_path)
    later.open(10 * 86400.0)
    assert list(later.buckets) == [(3600, "a", "m")] and later.rows(None)[0].requests == 3
    later.close()


# ---- the fair share ----------------------------------------------------------------------------------

def test_a_key_with_one_request_goes_before_a_flooding_keys_waiting_ones():
    fair = FairShare()
    flood = [fair.start("m", "a", 1.0) for _ in range(64)]
    assert flood == [i * SCALE for i in range(64)]
    assert fair.start("m", "b", 1.0) == 0  # ahead of every one of a's but its first
    assert fair.start("m", "b", 1.0) == SCALE  # then they take turns


def test_weights_give_turns_in_proportion_and_a_keys_own_order_is_kept():
    fair = FairShare()
    heavy = [fair.start("m", "h", 2.0) for _ in range(4)]
    light = [fair.start("m", "l", 1.0) for _ in range(2)]
    assert heavy == [0, 500, 1000, 1500] and light == [0, 1000]
    fair.done("m", "h", 0)
    fair.done("m", "h", 500)
    nxt = fair.start("m", "h", 2.0)  # 2 in flight → 1000, but never before its own 1500
    assert nxt == 1500
    for tag in (1000, 1500, 1500):
        fair.done("m", "h", tag)
    assert fair.start("m", "h", 2.0) == 0  # nothing in flight: from 0 again


@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abc"), st.integers(1, 3)), max_size=80))
def test_a_keys_priorities_never_go_back_while_it_has_requests_in_flight(ops):
    fair = FairShare()
    live: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    for start, key, _ in ops:
        if start or not live[key]:
            tag = fair.start("m", key, weights[key])
            assert tag >= max(live[key], default=0)
            live[key].append(tag)
        else:
            fair.done("m", key, live[key].pop(0))
    for key, tags in live.items():
        for tag in tags:
            fair.done("m", key, tag)
    assert fair.held == {}


# ---- what the client sees -------------------------------------------------------------------------------

def test_rate_limit_headers_are_openais():
    w = P.Window(limit_requests=60, remaining_requests=59, reset_requests_s=0.4, limit_tokens=1000,
                 remaining_tokens=0, reset_tokens_s=361.2)
    assert rate_headers(w) == {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
                               "x-ratelimit-reset-requests": "400ms", "x-ratelimit-limit-tokens": "1000",
                               "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m2s"}
    assert rate_headers(P.Window()) == {} and seconds(0) == "0s" and seconds(58.2) == "59s" and seconds(59.2) == "1m0s"


def test_usage_counters_are_prometheus_text_with_key_and_model_labels():
    rows = [P.UsageRow(key="team-a", model="m", requests=3, prompt_tokens=10, completion_tokens=20, errors=1),
            P.UsageRow(key="(none)", model='we"ird', requests=1)]
    families = {f.name: f for f in text_string_to_metric_families(key_usage_exposition(rows).decode())}
    assert set(families) == {"servectl_key_requests", "servectl_key_prompt_tokens", "servectl_key_completion_tokens",
                             "servectl_key_errors"}
    samples = {(s.labels["key"], s.labels["model"]): s.value for s in families["servectl_key_requests"].samples}
    assert samples == {("team-a", "m"): 3, ("(none)", 'we"ird'): 1}
    assert families["servectl_key_errors"].type == "counter"


def test_a_long_log_is_folded_while_running_and_a_bad_snapshot_is_kept_aside(tmp_path, monkeypatch):
    import manager.usage as U

    monkeypatch.setattr(U, "ROLL_LINES", 3)
    ledger = UsageLedger(tmp_path)
    ledger.open(0.0)
    for i in range(7):
        ledger.add("a", "m", 1, 2, False, 60.0 * i)
    ledger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3.log", SNAPSHOT]  # 1.log and 2.log folded
    again = UsageLedger(tmp_path)
    again.open(1000.0)
    assert (again.rows(None)[0].requests, again.rows(None)[0].completion_tokens) == (7, 14)
    again.close()
    (tmp_path / SNAPSHOT).write_text('{"absorbed": [], "buckets": [[0, "a", "m", "x"]]}')
    third = UsageLedger(tmp_path)
    third.open(2000.0)  # unreadable: moved aside, not overwritten; the counts start from the logs
    assert (tmp_path / "ledger.unreadable-2000").exists() and third.rows(None) == []
    third.close()


class FakeManager:
    def __init__(self, answer=None):
        self.answer = answer
        self.sent: list = []

    async def admit(self, msg, timeout_s):
        if self.answer is None:
            raise TimeoutError
        return self.answer

    def report_now(self, msg):
        self.sent.append(msg)


def request_of(key) -> dict:
    return {"key": key, "log": {}}


def test_a_limited_keys_slot_is_given_back_when_the_manager_does_not_answer():
    import asyncio

    from api_gateway.errors import HttpError
    from api_gateway.keys import RequestKey
    from api_gateway.tenancy import KeyGate

    manager = FakeManager()
    gate = KeyGate(manager, fair_share=True)
    req = request_of(RequestKey(Access.API, "a", named("a", max_concurrent_requests=1)))
    gate.check_model(req, "m", "m")
    with pytest.raises(HttpError) as info:
        asyncio.run(gate.admit(req, "m"))
    assert info.value.status == 503
    gate.finished(req, 503)
    (done,) = manager.sent
    assert done.ticket == 1 and done.error  # the Admit may still be taken: its slot is given back


def test_a_clients_priority_only_puts_its_request_back_and_an_early_end_reports_what_it_used():
    from api_gateway.keys import RequestKey
    from api_gateway.tenancy import KeyGate

    manager = FakeManager()
    gate = KeyGate(manager, fair_share=True)
    key = RequestKey(Access.API, "a", named("a"))
    first, second = request_of(key), request_of(key)
    for req, asked in ((first, -100), (second, 5000)):
        gate.check_model(req, "m", "m")
        forward = {"priority": asked}
        gate.prioritise(req, "chat", forward, 1)
        req["forward"] = forward
    assert first["forward"]["priority"] == 0 and second["forward"]["priority"] == 5000
    first["tally"] = lambda: (7, 3)  # the client went away after 3 tokens
    gate.finished(first, 499)
    assert (manager.sent[0].prompt_tokens, manager.sent[0].completion_tokens, manager.sent[0].error) == (7, 3, True)


def test_messages_and_speech_get_the_tag_through_the_engine_and_keyed_clients_no_negative_priority():
    from api_gateway.keys import RequestKey
    from api_gateway.tenancy import KeyGate

    gate = KeyGate(FakeManager(), fair_share=True)
    key = RequestKey(Access.API, "a", named("a"))
    first, second = request_of(key), request_of(key)
    for req in (first, second):
        gate.check_model(req, "m", "m")
    assert gate.prioritise(first, "chat", {}, 1) is None  # in the body
    forward: dict = {}
    assert gate.prioritise(second, "messages", forward, 1) == SCALE and forward == {}  # Generate.priority
    off = KeyGate(FakeManager(), fair_share=False)
    for req_key, asked, sent in ((key, -5, 0), (RequestKey(Access.API, "fp-1234"), -5, 0), (key, 9, 9),
                                 (OPEN, -5, -5)):
        req, forward = request_of(req_key), {"priority": asked}
        off.check_model(req, "m", "m")
        assert off.prioritise(req, "chat", forward, 1) is None and forward["priority"] == sent, (req_key, asked)
        assert off.tenant(req) == ""  # no fair share: no key on the engine request


def test_a_tagged_request_names_its_key_to_the_engine_and_a_batch_line_does_not():
    from api_gateway.keys import RequestKey
    from api_gateway.tenancy import KeyGate
    from api_gateway.translate import generate_messages

    gate = KeyGate(FakeManager(), fair_share=True)
    tagged, line = request_of(RequestKey(Access.API, "a", named("a"))), request_of(RequestKey(Access.API, "a",
                                                                                            named("a")))
    line["batch"] = True
    for req in (tagged, line):
        gate.check_model(req, "m", "m")
        gate.prioritise(req, "chat", {}, 1)
    assert gate.tenant(tagged) == "a" and gate.tenant(line) == ""
    ids = iter(["r1", "r2"])
    gens = generate_messages({}, ["x", "y"], lambda: next(ids), gate.tenant(tagged))
    assert [g.tenant for g in gens] == ["a", "a"]
