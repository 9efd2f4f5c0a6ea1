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
    def __init__(self, model_dir: str, max_model_len: int = 512):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_config = SimpleNamespace(max_model_len=max_model_len)
        self.requests: dict[str, dict] = {}
        self.token_id = self.tokenizer.encode("x", add_special_tokens=False)[0]

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, request_id, prompt, params) -> str:
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
    return ZeroCostEngine(spec.model.model)
