"""vLLM's per-step request outputs as the gateway's ``Delta``s.

One ``RequestOutput`` (DELTA kind: what is new since the last step) becomes
one ``Delta`` per choice: text, token ids, finish and stop reasons, logprob
entries (token text, logprob, top alternatives), and on a request's first
step its prompt's token count and, for echo, the prompt's text and logprobs.
The engine loop builds each request's deltas on its own: an error here
fails that request, not the step.
"""

from __future__ import annotations

from typing import Any

from servectl.wire import engine as P


class OutputBuilder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def deltas(self, ro, first: bool, prompt_tokens: int | None = None) -> list[P.Delta]:
        """The deltas of one request's output; ``first`` on its first step.

        ``prompt_tokens`` overrides the count reported (a resumed request's prompt holds
        the output it already had: the client's prompt is shorter).
        """
        out = []
        for comp in ro.outputs:
            delta = P.Delta(request_id=ro.request_id, index=comp.index, text=comp.text,
                            token_ids=list(comp.token_ids), finish_reason=comp.finish_reason,
                            stop_reason=comp.stop_reason)
            if first:
                delta.prompt_tokens = prompt_tokens if prompt_tokens is not None else len(ro.prompt_token_ids or ())
                if ro.prompt_logprobs is not None:
                    delta.prompt_logprobs = self.prompt_logprobs(ro)
                    # Echo returns the prompt as text, without BOS and other specials.
                    delta.prompt_text = self.tokenizer.decode(ro.prompt_token_ids, skip_special_tokens=True)
            if comp.logprobs:
                delta.logprobs = self.logprobs(comp.token_ids, comp.logprobs)
            out.append(delta)
        return out

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def logprobs(self, token_ids, logprobs) -> list[Any]:
        out = []
        for tid, alts in zip(token_ids, logprobs):
            chosen = alts.get(tid)
            top = sorted(alts.items(), key=lambda kv: kv[1].rank or 0)
            out.append([
                self.token_text(tid),
                chosen.logprob if chosen else None,
                [[self.token_text(t), lp.logprob] for t, lp in top if t != tid or lp.rank is not None],
            ])
        return out

    def prompt_logprobs(self, ro) -> list[Any]:
        out = []
        for tid, alts in zip(ro.prompt_token_ids, ro.prompt_logprobs):
            chosen = alts.get(tid) if alts else None
            top = sorted(alts.items(), key=lambda kv: kv[1].rank or 0) if alts else []
            out.append([self.token_text(tid), chosen.logprob if chosen else None,
                        [[self.token_text(t), lp.logprob] for t, lp in top]])
        return out
