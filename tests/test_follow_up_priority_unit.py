"""A Messages or speech request's later calls to vLLM keep the priority its first call was
given (the fair share's tag, ``Generate.priority``): a follow-up at 0 would jump its key's
turn, take a running request's slot (engine_core/slot_preemption.py) and make the engine yield
to it as to another key's first request (engine_core/batch_yield.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_core.intake import Intake
from engine_core.request_types import Built, OutputSpec
from engine_core.serving_apis import ApiRequest
from servectl.wire import engine as P

pytestmark = pytest.mark.unit


def call(priority_in_kwargs: int | None):
    kwargs = {} if priority_in_kwargs is None else {"priority": priority_in_kwargs}
    return SimpleNamespace(engine_input={"prompt_token_ids": [1, 2]}, params=SimpleNamespace(structured_outputs=None),
                           kwargs=kwargs)


@pytest.mark.parametrize("kwargs_priority", [None, 0, 7])
def test_a_later_call_keeps_the_first_calls_priority(kwargs_priority):
    api = ApiRequest.__new__(ApiRequest)
    api.priority = None
    first = ApiRequest._built(api, call(kwargs_priority))
    assert first.priority == (kwargs_priority or 0)  # vLLM's serving code's own, before the intake's
    intake = SimpleNamespace(builder=SimpleNamespace(build=lambda *a: first))
    msg = P.Generate(request_id="r", kind="messages", body={}, priority=3000)
    assert Intake._build(intake, msg) is first and first.priority == 3000 and api.priority == 3000
    assert ApiRequest._built(api, call(kwargs_priority)).priority == 3000  # the next call (speech_apis.py)


def test_a_request_without_a_serving_api_is_left_as_built():
    built = Built({"prompt_token_ids": [1]}, None, 5, None, OutputSpec(chat=False))
    intake = SimpleNamespace(builder=SimpleNamespace(build=lambda *a: built))
    assert Intake._build(intake, P.Generate(request_id="r", kind="completion", body={})).priority == 5
    assert Intake._build(intake, P.Generate(request_id="r", kind="completion", body={}, priority=9)).priority == 9


def test_a_requests_key_is_the_yields_only_while_vllm_adds_it_and_a_follow_up_keeps_it():
    """Intake._adding: the key on the yield only around vLLM's add (vLLM renames the request id
    and adds a child per n, so the yield tags whatever is added meanwhile), cleared after even
    when vLLM refuses the request; a Messages / speech follow-up is added with its first's key."""
    yielding = SimpleNamespace(arriving="")
    seen = []
    intake = SimpleNamespace(halves=SimpleNamespace(batches=yielding))
    intake._adding = lambda tenant: Intake._adding(intake, tenant)
    with Intake._adding(intake, "team-a"):
        seen.append(yielding.arriving)
    with pytest.raises(ValueError):
        with Intake._adding(intake, "team-b"):
            raise ValueError("refused by vLLM")
    with Intake._adding(intake, ""):  # no key (no fair share): nothing set
        seen.append(yielding.arriving)
    assert seen == ["team-a", ""] and yielding.arriving == ""
    added = []
    built = SimpleNamespace(add_to=lambda engine, rid: added.append((rid, yielding.arriving)))
    intake.tracing, intake.engine = None, None
    intake.requests = {"r1": SimpleNamespace(tenant="team-a")}
    Intake._add_next(intake, b"peer", "r1", built)
    assert added == [("r1", "team-a")] and yielding.arriving == ""
    without = SimpleNamespace()  # an engine without the yield (another policy): adds as before
    with Intake._adding(SimpleNamespace(halves=without), "team-a"):
        pass
