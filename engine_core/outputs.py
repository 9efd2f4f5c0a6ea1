"""vLLM's ``RequestOutput`` into the deltas a gateway turns into OpenAI responses.

Per token the engine decides what vLLM's OpenAI server would show, because
only it has the tokenizer and vLLM's ``Logprob`` objects: the token's text
(``decoded_token``, or ``token_id:N`` for ``return_tokens_as_token_ids``), its
logprob clamped at -9999, and which alternatives are listed — completions show
the first ``logprobs + 1`` entries of vLLM's per-token dict, chat the first
``top_logprobs`` (``OpenAIServingCompletion._create_completion_logprobs``,
``OpenAIServingChat._create_chat_logprobs``). A request's first delta carries
its prompt: token count, ids, echo text and logprobs, prompt_logprobs. The
engine loop builds each request's deltas on its own: an error here fails that
request, not the step.
"""

from __future__ import annotations

from typing import Any

from engine_core.request_types import OutputSpec
from servectl.wire import engine as P

FLOOR = -9999.0  # vLLM's stand-in for -inf in JSON


class OutputFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def deltas(self, ro, spec: OutputSpec, first: bool) -> list[P.Delta]:
        """One delta per choice with new output in ``ro``; the first one of a request carries its prompt."""
        if spec.api is not None:  # a Responses / Messages request: vLLM's serving code shows it
            return spec.api.deltas(ro, first)
        if spec.pooling is not None:  # one of a pooling request's prompts (pooling_apis.py)
            return spec.pooling.deltas(ro)
        out = []
        for comp in ro.outputs:
            delta = P.Delta(request_id=ro.request_id, index=comp.index, text=comp.text,
                            token_ids=list(comp.token_ids), finish_reason=comp.finish_reason,
                            stop_reason=comp.stop_reason)
            if spec.logprobs is not None and comp.logprobs:
                delta.logprobs = self.entries(comp.token_ids, comp.logprobs, spec)
            parsing = spec.parsing
            if parsing is not None:  # what vLLM's parsers show of it (chat_parsing.py)
                delta.message, delta.finish_reason, delta.reasoning_tokens = parsing.step(
                    comp.index, comp.text, list(comp.token_ids), comp.finish_reason)
                if parsing.hides_metadata:
                    delta.logprobs = None
                if spec.echo and parsing.whole and delta.message is not None and delta.message.get("content") is None:
                    delta.message["content"] = ""  # vLLM's echo: last message + (content or "")
            if first:
                delta.prompt = self.prompt_info(ro, spec)
                first = False
            out.append(delta)
        return out

    def prompt_info(self, ro, spec: OutputSpec) -> P.PromptInfo:
        ids = list(ro.prompt_token_ids or ())
        info = P.PromptInfo(tokens=len(ids))
        # vLLM's completion stream also sends the ids with an echo, asked for or not.
        if spec.return_token_ids or (spec.echo and not spec.chat):
            info.token_ids = ids
        prompt_logprobs = getattr(ro, "prompt_logprobs", None)
        if prompt_logprobs is not None:
            info.prompt_logprobs = [None if step is None else {
                str(tid): {"logprob": FLOOR if lp.logprob == float("-inf") else lp.logprob, "rank": lp.rank,
                           "decoded_token": lp.decoded_token} for tid, lp in step.items()}
                for step in prompt_logprobs]
        if spec.chat:
            info.role = spec.role
            info.constrained = spec.constrained
            if spec.parsing is not None:
                info.parsed = True
                info.reasoning_usage = spec.parsing.counts_reasoning
                info.metadata_hidden = spec.parsing.hides_metadata
            info.echo_text = spec.echo_text
            if spec.return_prompt_text:
                info.prompt_text = getattr(ro, "prompt", None)
        elif spec.echo:
            # OpenAIServingCompletion: with return_token_ids the echoed prompt text is "" (the ids say it).
            info.echo_text = "" if spec.return_token_ids else (getattr(ro, "prompt", None) or "")
            if spec.logprobs is not None:
                info.echo_logprobs = self.entries(ids, prompt_logprobs or [None] * len(ids), spec)
        return info

    # ---- logprobs ------------------------------------------------------------------------------
    def _decoded(self, logprob, token_id: int, spec: OutputSpec) -> str:
        """``GenerateBaseServing._get_decoded_token``."""
        if spec.as_token_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def entries(self, token_ids, steps, spec: OutputSpec) -> list[Any]:
        """[token, logprob or None, alternatives or None, bytes or None] per token."""
        out: list[Any] = []
        k = spec.logprobs
        for tid, step in zip(token_ids, steps):
            chosen = step.get(tid) if step is not None else None
            if chosen is None:
                token = f"token_id:{tid}" if spec.as_token_ids else self.tokenizer.decode(tid)
                out.append([token, None, None, list(token.encode("utf-8", errors="replace")) if spec.chat else None])
                continue
            if spec.chat:
                keep = [spec.all_alternatives or k == -1 or (k is not None and i < k) for i in range(len(step))]
                raw = chosen.decoded_token
                data = None if raw is None else list(raw.encode("utf-8", errors="replace"))
            else:
                keep = [spec.all_alternatives or k == -1 or (k is not None and k >= i) for i in range(len(step))]
                data = None
            alts = [[self._decoded(lp, t, spec), max(lp.logprob, FLOOR)]
                    for (t, lp), kept in zip(step.items(), keep) if kept]
            out.append([self._decoded(chosen, tid, spec), max(chosen.logprob, FLOOR), alts, data])
        return out
