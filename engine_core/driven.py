"""vLLM's async serving code run without an event loop, fed one step's output at a time.

vLLM's Responses and Messages serving classes (serving_apis.py) are async, but
between two outputs they wait for nothing but the engine's feed. They are given
a ``ServingEngineClient``, what those classes see of an engine, whose
``generate`` call is only recorded (``GenerateCall``); the engine loop puts
each step's ``RequestOutput`` into that call's ``OutputFeed``. ``Driven`` runs
the code turn by turn, until it needs the next output or ends, with
``uuid.uuid4`` seeded by the request's id meanwhile (``_SeededIds``), so the
same request fed the same outputs mints the same ids.
"""

from __future__ import annotations

import random
import uuid
from collections import deque
from typing import Any


class _Wait:
    """What the driven serving code yields to its driver when the feed has nothing yet."""

    def __await__(self):
        yield self


_WAIT = _Wait()


class OutputFeed:
    """The async iterator of ``RequestOutput`` vLLM's serving code reads (``engine_client.generate``)."""

    def __init__(self):
        self.outputs: deque = deque()
        self.ended = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self.outputs:
            if self.ended:
                raise StopAsyncIteration
            await _WAIT
        return self.outputs.popleft()

    async def aclose(self):  # vLLM closes its generators on the way out
        self.ended = True


class GenerateCall:
    """The arguments of one ``engine_client.generate`` call, and its feed."""

    def __init__(self, engine_input, sampling_params, request_id: str, kwargs: dict[str, Any]):
        self.engine_input = engine_input
        self.params = sampling_params
        self.request_id = request_id
        self.kwargs = kwargs
        self.feed = OutputFeed()


class ServingEngineClient:
    """What vLLM's serving classes use of an ``EngineClient``: the engine's configuration,
    renderer and input processor; admission is the gateway's; ``generate`` is recorded."""

    errored = False
    dead_error = None

    def __init__(self, vllm_config, renderer, input_processor):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = input_processor
        self.calls: list[GenerateCall] = []

    def check_admission(self, n: int = 1) -> None:
        return None

    def generate(self, engine_input, sampling_params, request_id, **kwargs):
        call = GenerateCall(engine_input, sampling_params, request_id, kwargs)
        self.calls.append(call)
        return call.feed


class _SeededIds:
    """``uuid.uuid4`` while one request's serving code runs: ids from its own seeded generator."""

    def __init__(self, request_id: str):
        self.rng = random.Random(f"servectl:{request_id}")

    def uuid4(self):
        return uuid.UUID(int=self.rng.getrandbits(128), version=4)


class Driven:
    """A vLLM serving coroutine (a whole answer) or async generator (a stream) run without an
    event loop: ``turn`` runs it until it waits for the feed or ends, and returns what it
    produced meanwhile."""

    def __init__(self, ids: _SeededIds, coro):
        self.ids = ids
        self.coro = coro  # the create_* coroutine, then (a stream) its async generator
        self.stream = None
        self.pending = None  # the awaitable in progress (a coroutine's, or the generator's __anext__)
        self.result = None
        self.done = False

    def turn(self) -> list:
        """Run until the serving code waits for output or ends; the stream items it yielded."""
        saved, uuid.uuid4 = uuid.uuid4, self.ids.uuid4
        try:
            return self._turn()
        finally:
            uuid.uuid4 = saved

    def _turn(self) -> list:
        items: list = []
        while not self.done:
            if self.stream is None:
                try:
                    yielded = self.coro.send(None)
                except StopIteration as end:
                    value = end.value
                    if hasattr(value, "__anext__"):  # create_* returned a stream
                        self.stream = value
                        continue
                    self.result, self.done = value, True
                    break
                _only_the_feed(yielded)
                break
            if self.pending is None:
                self.pending = self.stream.__anext__()
            try:
                yielded = self.pending.send(None)
            except StopIteration as got:
                self.pending = None
                items.append(got.value)
                continue
            except StopAsyncIteration:
                self.pending, self.done = None, True
                break
            _only_the_feed(yielded)
            break
        return items

    def close(self) -> None:
        """Abandon it (an abort, a failure): its ``finally`` blocks run, as a cancelled request's do."""
        if self.pending is not None:  # the stream, suspended mid-step: GeneratorExit at that await
            try:
                self.pending.throw(GeneratorExit)
            except (GeneratorExit, StopIteration, StopAsyncIteration, RuntimeError):
                pass
            self.pending = None
        if self.stream is not None:
            _run_once(self.stream.aclose())
        try:
            self.coro.close()
        except RuntimeError:  # it swallowed GeneratorExit: nothing more to do for it
            pass
        self.done = True


def _run_once(awaitable) -> None:
    try:
        awaitable.send(None)
    except (StopIteration, StopAsyncIteration, GeneratorExit, RuntimeError):
        pass
    else:
        awaitable.close()


def _only_the_feed(yielded) -> None:
    if yielded is not _WAIT:
        raise RuntimeError(f"vLLM's serving code waited for {type(yielded).__name__} "
                           "(servectl runs it without an event loop)")
