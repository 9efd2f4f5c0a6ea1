"""A non-streaming request's output held and merged (engine_core/coalesce.py), and the engine
loop's use of it: first delta at once, the rest at the end or every HOLD_S, nothing lost."""

from __future__ import annotations

import pytest

from engine_core.coalesce import HOLD_S, HeldOutput, merge
from servectl.wire import engine as P

pytestmark = pytest.mark.unit


def d(rid="r", index=0, text="", tokens=(), finish=None, stop=None, logprobs=None, prompt=None) -> P.Delta:
    return P.Delta(request_id=rid, index=index, text=text, token_ids=list(tokens), finish_reason=finish,
                   stop_reason=stop, logprobs=logprobs, prompt=prompt)


def test_merge_concatenates_each_choice_in_order_and_keeps_the_end():
    info = P.PromptInfo(tokens=2, token_ids=[1, 2])
    parts = [d(text="Hel", tokens=[1], logprobs=[["Hel", -0.1, None, None]], prompt=info),
             d(index=1, text="A", tokens=[7]),
             d(text="lo", tokens=[2], logprobs=[["lo", -0.2, None, None]]),
             d(index=1, text="B", tokens=[8], finish="stop", stop="\n"),
             d(text="!", tokens=[3], logprobs=[["!", -0.3, None, None]], finish="length")]
    out = merge(parts)
    assert [(m.index, m.text, m.token_ids, m.finish_reason, m.stop_reason) for m in out] == [
        (0, "Hello!", [1, 2, 3], "length", None), (1, "AB", [7, 8], "stop", "\n")]
    assert [e[0] for e in out[0].logprobs] == ["Hel", "lo", "!"] and out[1].logprobs is None
    assert out[0].prompt == info
    # The inputs are not changed (they may still be referenced).
    assert parts[0].token_ids == [1] and parts[0].text == "Hel"


def test_held_until_the_end_or_the_hold_time_then_sent_merged():
    held = HeldOutput()
    assert held.take("r", [d(text="a", tokens=[1])], finished=False, now=10.0) == []
    assert held.take("r", [d(text="b", tokens=[2])], finished=False, now=10.0 + HOLD_S / 2) == []
    out = held.take("r", [d(text="c", tokens=[3])], finished=False, now=10.0 + HOLD_S)
    assert [(m.text, m.token_ids) for m in out] == [("abc", [1, 2, 3])] and len(held) == 0
    held.take("r", [d(text="d", tokens=[4])], finished=False, now=11.0)
    out = held.take("r", [d(text="e", tokens=[5], finish="length")], finished=True, now=11.01)
    assert [(m.text, m.finish_reason) for m in out] == [("de", "length")] and len(held) == 0
    # Finished with nothing held: as it is. Dropped (aborted, failed): gone.
    assert held.take("s", [d(rid="s", text="x")], finished=True, now=12.0)[0].text == "x"
    held.take("t", [d(rid="t")], finished=False, now=12.0)
    held.drop("t")
    assert len(held) == 0
