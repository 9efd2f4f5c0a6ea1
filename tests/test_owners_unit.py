"""One owner per fact: background tasks, the gateway's handler table, a link's words, shared constants."""

from __future__ import annotations

import asyncio
import gc
import logging
import re

import pytest

from api_gateway.engines import EngineLink, LinkState
from api_gateway.link_state import MANAGER_STATES, WORDS
from manager import audit
from servectl import config as C
from servectl import paths
from servectl.tasks import Tasks
from servectl.wire import control as CP
from servectl.wire import engine as EP
from servectl.wire.vocab import MODEL_NAME, ModelState

pytestmark = pytest.mark.unit


# ---- servectl/tasks.py ------------------------------------------------------------------------

def test_a_background_task_is_kept_until_it_ends_and_its_failure_is_logged(caplog):
    tasks = Tasks(logging.getLogger("test.tasks"))
    done = []

    async def ok(gate: asyncio.Event) -> None:
        await gate.wait()
        done.append("ok")

    async def broken() -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        gate = asyncio.Event()
        task = tasks.start(ok(gate), "waits")
        del task
        gc.collect()  # only the owner holds it now
        assert [t.get_name() for t in tasks.running] == ["waits"]
        tasks.start(broken(), "breaks")
        await asyncio.sleep(0)  # event-proof: lets the failing task run once
        await asyncio.sleep(0)  # event-proof: and its done callback
        gate.set()
        while tasks.running:
            await asyncio.sleep(0)  # event-proof: turns of the loop until both ended

    with caplog.at_level(logging.ERROR, "test.tasks"):
        asyncio.run(main())
    assert done == ["ok"] and tasks.running == set()
    failures = [r for r in caplog.records if r.name == "test.tasks"]
    assert len(failures) == 1 and "'breaks' failed" in failures[0].getMessage()
    assert failures[0].exc_info[0] is RuntimeError


def test_a_cancelled_background_task_is_not_a_failure(caplog):
    tasks = Tasks(logging.getLogger("test.tasks"))

    async def main() -> None:
        tasks.start(asyncio.Event().wait(), "forever")
        await asyncio.sleep(0)  # event-proof: lets it start waiting
        tasks.cancel_all()
        while tasks.running:
            await asyncio.sleep(0)  # event-proof: turns of the loop until it ended

    with caplog.at_level(logging.ERROR, "test.tasks"):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.name == "test.tasks"]


# ---- the gateway's engine messages: one handler each ---------------------------------------------

def test_every_engine_message_has_one_gateway_handler():
    async def main() -> EngineLink:
        return EngineLink("m", "/nonexistent", None, b"gw")

    link = asyncio.run(main())
    assert set(link.on_engine) | {EP.HelloReply} == set(EP.ToGateway.__args__)


# ---- a link's words are derived from its state -----------------------------------------------------

def test_every_link_state_has_a_word_and_each_managers_word_names_its_state():
    assert set(WORDS) == set(LinkState)
    for word, state in MANAGER_STATES.items():
        assert word in ModelState and state in LinkState


@pytest.mark.parametrize("said, word", [(ModelState.BACKOFF, "backoff"), (ModelState.EXITED, "exited"),
                                        (ModelState.STOPPING, "stopping"), (ModelState.ASLEEP, "asleep")])
def test_a_link_says_the_managers_word_that_put_it_in_its_state(said, word):
    async def main() -> None:
        link = EngineLink("m", "/nonexistent", None, b"gw")
        link.on_model_state(said, "", None)
        assert link.status == word
        link.remove()
        assert (link.state, link.status) == (LinkState.REMOVED, "removed")

    asyncio.run(main())


# ---- each shared constant written once ---------------------------------------------------------------

def test_shared_constants_have_one_definition():
    assert audit.READ_ONLY is CP.READ_ONLY == (CP.StatusRequest, CP.WaitSettled, CP.UsageRequest)
    assert C.NAME_PATTERN == rf"^{MODEL_NAME}\Z" and paths._MODEL is MODEL_NAME
    assert re.match(C.NAME_PATTERN, "m.1-x_2") and not re.match(C.NAME_PATTERN, "m:1")
