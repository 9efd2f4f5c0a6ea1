"""A step's reply of sampled tokens only: unsigned msgpack, equal to the pickle it replaces, or not sent so.

The codec's one rule (engine_core/workers/tokens_reply.py): it encodes only what it
decodes back into an equal value of the same type; everything else stays a
signed pickle. Checked on a stand-in of ``ModelRunnerOutput``'s shape (no
vLLM here), through the real worker loop and the engine's group, and on
the stream: an unsigned frame is never unpickled, a garbled one is dropped
and counted, and a group without a codec takes none.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_core.workers.link import HEADER, UNSIGNED, UNSIGNED_FLAG, FrameReader
from engine_core.workers.signing import BadSignature, Signer
from engine_core.workers.tokens_reply import BadTokensReply, TokensReplyCodec
from hop_fixtures import KEY, ctx, doubles, make_group, start_worker  # noqa: F401  (fixtures)
from servectl.wire.worker import EXECUTE_AND_SAMPLE

pytestmark = pytest.mark.unit


@dataclasses.dataclass
class StepOutput:
    """The shape of vLLM's ModelRunnerOutput: two required fields, defaults of every kind."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: Any = None
    prompt_logprobs_dict: dict[str, Any] = dataclasses.field(default_factory=dict)
    pooler_output: list | None = None
    num_nans_in_logits: dict[str, int] | None = None
    spec_flag: bool = False


def plain(req_ids: list[str], tokens: list[list[int]]) -> StepOutput:
    return StepOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                      sampled_token_ids=tokens)


CODEC = TokensReplyCodec(StepOutput)


# ---- the codec ------------------------------------------------------------------------------

@pytest.mark.deep
@given(ids=st.lists(st.text(max_size=40), unique=True, max_size=70),
       data=st.data(), call_id=st.integers(min_value=0, max_value=2**63 - 1),
       empty=st.sets(st.sampled_from(["logprobs", "pooler_output", "num_nans_in_logits"])))
def test_a_reply_of_tokens_only_decodes_to_an_equal_value(ids, data, call_id, empty):
    tokens = data.draw(st.lists(st.lists(st.integers(-2**63, 2**64 - 1), max_size=4),
                                min_size=len(ids), max_size=len(ids)))
    value = plain(ids, tokens)
    for name in empty:  # as vLLM's runner sets num_nans_in_logits = {} on every sampled step
        setattr(value, name, {})
    payload = CODEC.encode(call_id, value)
    assert payload is not None
    got_id, ok, got = CODEC.decode(payload)
    assert (got_id, ok) == (call_id, True)
    assert type(got) is StepOutput and got == value


NOT_PLAIN = {
    "logprobs": lambda v: setattr(v, "logprobs", ([1], [0.5])),
    "prompt logprobs": lambda v: v.prompt_logprobs_dict.update({"a": None}),
    "pooler output": lambda v: setattr(v, "pooler_output", []),  # [] is not the default None
    "nans": lambda v: setattr(v, "num_nans_in_logits", {"a": 1}),
    "an empty dict of another type": lambda v: setattr(v, "num_nans_in_logits", SubDict()),
    "a constant off its default": lambda v: setattr(v, "spec_flag", True),
    "index not the ids' order": lambda v: setattr(v, "req_id_to_index", {"a": 1, "b": 0}),
    "index of another length": lambda v: setattr(v, "req_id_to_index", {"a": 0}),
    "a token that is not an int": lambda v: setattr(v, "sampled_token_ids", [[1.0], [2]]),
    "a bool token": lambda v: setattr(v, "sampled_token_ids", [[True], [2]]),
    "a tuple of tokens": lambda v: setattr(v, "sampled_token_ids", [(1,), [2]]),
    "an int subclass": lambda v: setattr(v, "sampled_token_ids", [[IntLike(1)], [2]]),
    "an int past msgpack's 64 bits": lambda v: setattr(v, "sampled_token_ids", [[2**64], [2]]),
    "an int below msgpack's": lambda v: setattr(v, "sampled_token_ids", [[-2**63 - 1], [2]]),
    "a lone surrogate in an id": lambda v: (setattr(v, "req_ids", ["\ud800", "b"]),
                                            setattr(v, "req_id_to_index", {"\ud800": 0, "b": 1})),
    "tokens for fewer requests than there are": lambda v: setattr(v, "sampled_token_ids", [[1]]),
    "a dict of the wrong type": lambda v: setattr(v, "prompt_logprobs_dict", SubDict()),
}


class IntLike(int):
    pass


class SubDict(dict):
    pass


@pytest.mark.parametrize("why", sorted(NOT_PLAIN))
def test_anything_more_than_tokens_is_left_to_the_signed_pickle(why):
    value = plain(["a", "b"], [[1], [2]])
    assert CODEC.encode(7, value) is not None
    NOT_PLAIN[why](value)
    assert CODEC.encode(7, value) is None


def test_a_step_that_sampled_nothing_is_a_tokens_reply_too():
    value = plain(["a", "b"], [])  # e.g. vLLM's empty output: ids, no tokens
    assert CODEC.decode(CODEC.encode(3, value)) == (3, True, value)


def test_other_types_and_call_ids_are_left_to_the_signed_pickle():
    @dataclasses.dataclass
    class Other(StepOutput):
        pass

    assert CODEC.encode(7, Other(req_ids=[], req_id_to_index={})) is None  # a subclass is not the type
    assert CODEC.encode(7, {"req_ids": []}) is None
    assert CODEC.encode("7", plain([], [])) is None  # call ids are ints


def test_a_type_with_a_field_that_has_no_default_turns_the_codec_off():
    @dataclasses.dataclass
    class Grown:
        req_ids: list[str]
        req_id_to_index: dict[str, int]
        sampled_token_ids: list[list[int]]
        something_new: int  # vLLM added a required field: it would have to be sent

    codec = TokensReplyCodec(Grown)
    assert not codec.usable
    assert codec.encode(1, Grown([], {}, [], 3)) is None
    with pytest.raises(BadTokensReply):
        codec.decode(CODEC.encode(1, plain([], [])))
    assert not TokensReplyCodec(dict).usable  # not a dataclass


@pytest.mark.parametrize("payload", [
    b"", b"\x93", b"garbage",
    msgspec.msgpack.encode([1, ["a"], [[1.5]]]),  # a float token
    msgspec.msgpack.encode([1, ["a", "a"], [[1], [2]]]),  # a request id twice
    msgspec.msgpack.encode({"call_id": 1, "req_ids": [], "sampled_token_ids": []}),  # not the array form
    msgspec.msgpack.encode([1, ["a"]]),  # a field short
    msgspec.msgpack.encode([1, ["a"], [[1]], ["req_ids"]]),  # an empty dict for a field whose default is not None
    msgspec.msgpack.encode([1, ["a"], [[1]], ["no_such_field"]]),
    msgspec.msgpack.encode([1, ["a", "b"], [[1]]]),  # tokens for one of two requests
])
def test_a_garbled_or_inconsistent_payload_is_a_bad_reply(payload):
    with pytest.raises(BadTokensReply):
        CODEC.decode(payload)


# ---- on the stream --------------------------------------------------------------------------

def test_an_unsigned_frame_is_marked_in_its_length_and_never_unpickled():
    payload = CODEC.encode(3, plain(["a"], [[9]]))
    data = HEADER.pack(len(payload) | UNSIGNED_FLAG, b"") + payload
    reader = FrameReader()
    cut = HEADER.size + 2
    assert reader.feed(data[:cut]) == []  # a short read waits for the rest, the flag not counted as length
    assert reader.wanted() == len(data) - cut
    assert reader.feed(data[cut:]) == [[UNSIGNED, payload]]
    signer = Signer(KEY)
    with pytest.raises(BadSignature, match="unsigned"):
        signer.loads([UNSIGNED, payload])
    assert signer.rejected == 1


def test_an_unsigned_length_past_the_limit_is_still_a_frame_error():
    from engine_core.workers.link import FrameError

    with pytest.raises(FrameError):
        FrameReader(max_payload=100).feed(HEADER.pack(101 | UNSIGNED_FLAG, b"") + b"x" * 101)


# ---- through the worker loop and the engine's group --------------------------------------------

class Runner:
    """A model runner whose step returns what the test put in ``outputs``."""

    def __init__(self):
        self.outputs: list[Any] = []

    def execute_model(self, scheduler_output):
        return self.outputs.pop(0)


class NoAsync:  # no async outputs from this runner
    pass


@pytest.fixture
def worker(ctx, tmp_path):
    runner = Runner()
    start_worker(ctx, tmp_path / "w0", runner, async_type=NoAsync, tokens_codec=CODEC)
    return runner


def test_the_worker_sends_tokens_unsigned_and_the_rest_signed(ctx, tmp_path, worker):
    g = make_group(ctx, tmp_path, codec=CODEC, spin_s=0.0)
    first, second = plain(["r1", "r2"], [[5], [6]]), plain(["r1"], [[7]])
    with_logprobs = plain(["r1"], [[8]])
    with_logprobs.logprobs = ([8], [-0.1])
    worker.outputs += [first, second, with_logprobs]
    got = [g.call(EXECUTE_AND_SAMPLE, (SimpleNamespace(step=n),), None)[0] for n in range(3)]
    assert got == [first, second, with_logprobs]
    assert all(type(v) is StepOutput for v in got)
    assert (g.token_replies, g.signed_replies) == (2, 1)
    assert "2 repl(ies) as sampled tokens, 1 as signed pickles" in g.counters()


def test_a_garbled_unsigned_reply_is_dropped_and_counted_and_the_right_one_still_settles(ctx, tmp_path,
                                                                                          doubles):
    d = doubles("manual")
    g = make_group(ctx, tmp_path, codec=CODEC, spin_s=0.0)
    fut = g.send("execute_model", (1,), None)
    call_id = d.wait_calls(1)[0][0]
    d.reply(call_id, raw=[UNSIGNED, b"not msgpack"])
    d.reply(call_id, raw=[UNSIGNED, CODEC.encode(call_id, plain(["a"], [[1]]))])
    assert fut.result() == [plain(["a"], [[1]])]
    assert g.signer.rejected == 1 and g.token_replies == 1


def test_a_group_without_a_codec_rejects_unsigned_replies(ctx, tmp_path, doubles):
    d = doubles("manual")
    g = make_group(ctx, tmp_path, codec=None, spin_s=0.0)
    fut = g.send("execute_model", (1,), None)
    call_id = d.wait_calls(1)[0][0]
    d.reply(call_id, raw=[UNSIGNED, CODEC.encode(call_id, plain(["a"], [[1]]))])
    d.reply(call_id, value="signed")
    assert fut.result() == ["signed"]
    assert g.signer.rejected == 1 and (g.token_replies, g.signed_replies) == (0, 1)
