"""A zero-cost token source for measuring the serving layer's own ceiling.

Plugs into the engine process through the documented engine-factory hook
(``SERVECTL_ENGINE_FACTORY=bench.zero_cost:make_engine`` in a model's ``env``):
the same gateway → ZeroMQ → engine loop path, with ``step()`` producing one
token for every running request instantly. What tokens/s the tree then moves is
what the serving layer can carry before the model matters.
"""

from __future__ import annotations

from types import SimpleNamespace


class ZeroCostEngine:
    """vLLM's model config and renderer (requests are built exactly as for LLMEngine), no model."""

    def __init__(self, model_dir: str, engine_args: dict | None = None):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.renderers import renderer_from_config

        config = EngineArgs(model=model_dir, **(engine_args or {})).create_engine_config()
        self.model_config = config.model_config
        self.renderer = renderer_from_config(config)
        self.tokenizer = self.renderer.get_tokenizer()
        self.requests: dict[str, dict] = {}
        self.token_id = self.tokenizer.encode("x", add_special_tokens=False)[0]

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, request_id, prompt, params, **_) -> str:
        self.requests[request_id] = {"prompt": prompt["prompt_token_ids"], "left": params.max_tokens or 16,
                                     "n": params.n}
        return request_id

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self):
        outputs = []
        for rid, st in list(self.requests.items()):
            st["left"] -= 1
            done = st["left"] <= 0
            choices = [SimpleNamespace(index=i, text="x", token_ids=[self.token_id],
                                       finish_reason="length" if done else None, stop_reason=None, logprobs=None)
                       for i in range(st["n"])]
            outputs.append(SimpleNamespace(request_id=rid, outputs=choices, prompt_token_ids=st["prompt"],
                                           prompt_logprobs=None, finished=done))
            if done:
                del self.requests[rid]
        return outputs


def make_engine(spec) -> ZeroCostEngine:
    from engine_core.main import engine_args

    return ZeroCostEngine(spec.model.model, engine_args(spec.model))
