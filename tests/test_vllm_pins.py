"""The vLLM code servectl copies, patches or reaches into is the installed vLLM's (tools/vllm_pins.py).

Imports vLLM, starts no daemon: the vllm_unit tier. A vLLM upgrade that
changes ``LLMEngine.step`` (copied as engine_core/step_halves.py's two
halves), the CPU platform's ``check_and_update_config`` (wrapped by
engine_core/workers/executor.py), ``EngineCoreClient.make_client`` or what
the constructors set the reached attributes to (``engine.engine_core
.engine_core``, its ``scheduler`` and ``batch_queue``,
``output_processor.request_states``, a request state's ``detokenizer``)
fails here, naming the piece and the servectl code to re-read, until that
code is checked and ``python -m tools.vllm_pins`` re-pins it. The reached
attributes are also checked to be of the types servectl uses them as.
"""

from __future__ import annotations

import inspect
import json

import pytest

from tools import vllm_pins

pytestmark = pytest.mark.vllm_unit


def test_every_copied_patched_or_reached_piece_is_the_installed_vllms():
    problems = vllm_pins.differences(json.loads(vllm_pins.OUT.read_text()), vllm_pins.collect())
    assert problems == [], "\n".join(problems)


def test_a_pin_fails_naming_the_piece_when_vllm_changes_it():
    recorded = json.loads(vllm_pins.OUT.read_text())
    step = vllm_pins.installed_source("vllm.v1.engine.llm_engine:LLMEngine.step")
    reformatted = step.replace("# 1) Get EngineCoreOutput", "# (a comment vLLM reworded)").replace(
        "outputs = self.engine_core.get_output()", "outputs = (\n            self.engine_core.get_output()\n        )")
    altered = step.replace("self.engine_core.abort_requests(processed_outputs.reqs_to_abort)", "pass")
    assert altered != step and reformatted != step
    states = vllm_pins.installed_source("vllm.v1.engine.output_processor:OutputProcessor.__init__")
    renamed = states.replace("self.request_states: dict[str, RequestState] = {}", "self.states = {}")
    assert renamed != states

    def source_of(sources):
        return lambda pin: sources.get(pin.name) or vllm_pins.installed_source(pin.where)

    # Comments and formatting are not changes ...
    same = vllm_pins.collect(source_of({"LLMEngine.step": reformatted}))
    assert vllm_pins.differences(recorded, same) == []
    # ... what the code does is, and the failure names the piece and what to re-read.
    changed = vllm_pins.collect(source_of({"LLMEngine.step": altered,
                                           "OutputProcessor.request_states": renamed}))
    problems = vllm_pins.differences(recorded, changed)
    assert len(problems) == 2
    assert problems[0].startswith("LLMEngine.step (vllm.v1.engine.llm_engine:LLMEngine.step) changed")
    assert "engine_core/step_halves.py" in problems[0]
    assert problems[1].startswith("OutputProcessor.request_states: vLLM no longer sets self.request_states")
    assert "engine_core/resume.py" in problems[1]
    # An attribute set to something else is named with both.
    retyped = states.replace("self.request_states: dict[str, RequestState] = {}",
                             "self.request_states: list[RequestState] = []")
    problems = vllm_pins.differences(recorded, vllm_pins.collect(source_of({"OutputProcessor.request_states": retyped})))
    assert len(problems) == 1 and "now ['self.request_states: list[RequestState] = []']" in problems[0]


def test_every_piece_is_pinned():
    recorded = json.loads(vllm_pins.OUT.read_text())
    assert set(recorded["pins"]) == {pin.name for pin in vllm_pins.PINS}


def test_the_reached_attributes_are_what_servectl_uses_them_as():
    """The paths the engine reaches exist with the types it uses (read from vLLM's own classes)."""
    import collections

    import vllm.v1.engine.core as core
    import vllm.v1.engine.core_client as client
    import vllm.v1.engine.output_processor as op
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    # The CPU platform's check is a classmethod (executor.py wraps its __func__).
    assert isinstance(inspect.getattr_static(CpuPlatform, "check_and_update_config"), classmethod)
    # engine.engine_core: the in-process client, with what the step halves call on it ...
    assert issubclass(client.InprocClient, client.EngineCoreClient)
    for name in ("get_output", "execute_dummy_batch", "abort_requests"):
        assert name in vars(client.InprocClient), name
    # ... whose engine_core is vLLM's EngineCore, with a scheduler that answers has_requests().
    assert client.EngineCore is core.EngineCore
    assert callable(getattr(core.SchedulerInterface, "has_requests", None))
    assert core.deque is collections.deque  # batch_queue: a deque, or None without async scheduling
    # output_processor.request_states: a dict of RequestState, and what the step halves call on it.
    processor = op.OutputProcessor(None, log_stats=False)
    assert type(processor.request_states) is dict
    assert callable(processor.process_outputs) and callable(processor.update_scheduler_stats)
    assert op.IncrementalDetokenizer is IncrementalDetokenizer
