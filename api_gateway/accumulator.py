"""One response, built from the engine's deltas, for streamed and whole answers alike.

The engine sends, per step, one ``Delta`` per choice of each request: new
text, token ids, logprob entries, a finish reason, and on a request's first
step its prompt's token count (and, for echo, the prompt's text and
logprobs). ``ResponseAccumulator.add`` is the one place that reads a delta:
it counts usage, notes the first token's time, puts the echoed prompt in
front of a choice's first output and maps (prompt, choice) to the response's
choice index. A stream turns each result into a chunk; a whole response
keeps them and builds its body at the end. Pure: no I/O, clock injectable.
"""

from __future__ import annotations

import time
from typing import Callable

from api_gateway import openai_types as H
from api_gateway.translate import chat_logprobs, completion_logprobs
from servectl.wire.engine import Delta


class ChoiceDelta:
    """What one delta adds to one choice of the response."""

    __slots__ = ("index", "text", "logprobs", "finish_reason", "first")

    def __init__(self, index: int, text: str, logprobs: list, finish_reason: str | None, first: bool):
        self.index = index  # the choice's index in the response: prompt index * n + choice
        self.text = text  # with the echoed prompt in front on the choice's first delta
        self.logprobs = logprobs  # entries of this delta's tokens (the echoed prompt's first)
        self.finish_reason = finish_reason
        self.first = first  # the choice's first delta (a chat stream names the role in it)


class ResponseAccumulator:
    """Usage, echo, index mapping and (when kept) per-choice text of one OpenAI response.

    ``req`` is the validated CompletionRequest or ChatCompletionRequest; ``prompts`` the number
    of engine requests it became (a chat is one). ``keep`` records every choice's text, logprobs
    and finish reason for ``response()``; a stream, which sends them as they come, passes False.
    """

    def __init__(self, req, chat: bool, prompts: int, response_id: str, keep: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.model = req.model
        self.chat = chat
        self.n = req.n
        self.echo = bool(getattr(req, "echo", False))
        # Chat: logprobs is a bool; completions: the number of alternatives, or None for none.
        self.logprobs = req.logprobs if chat else req.logprobs is not None
        self.top_k = 0 if chat else req.logprobs
        self.id = response_id
        self.keep = keep
        self.clock = clock
        self.prompt_tokens = [0] * prompts
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.echoes: dict[int, tuple[str, list]] = {}  # prompt index -> (prompt text, prompt logprobs)
        self.started: set[int] = set()  # choice indexes that have had a delta
        self.texts: dict[int, list[str]] = {}
        self.entries: dict[int, list] = {}
        self.finish: dict[int, str | None] = {}

    def add(self, pi: int, d: Delta) -> ChoiceDelta:
        """Account for one delta of prompt ``pi``'s request."""
        if d.token_ids:
            if self.first_token_at is None:
                self.first_token_at = self.clock()
            self.completion_tokens += len(d.token_ids)
        if d.prompt_tokens is not None:
            self.prompt_tokens[pi] = d.prompt_tokens
        if d.prompt_logprobs is not None:
            self.echoes[pi] = (d.prompt_text or "", d.prompt_logprobs)
        index = pi * self.n + d.index
        first = index not in self.started
        if first:
            self.started.add(index)
        text = d.text
        entries = d.logprobs or []
        if first and self.echo and pi in self.echoes:
            prompt_text, prompt_entries = self.echoes[pi]
            text = prompt_text + text
            entries = prompt_entries + entries
        if self.keep:
            self.texts.setdefault(index, []).append(text)
            if entries:
                self.entries.setdefault(index, []).extend(entries)
            if d.finish_reason is not None:
                self.finish[index] = d.finish_reason
            else:
                self.finish.setdefault(index, None)
        return ChoiceDelta(index, text, entries, d.finish_reason, first)

    def usage(self) -> H.Usage:
        prompt = sum(self.prompt_tokens)
        return H.Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                       total_tokens=prompt + self.completion_tokens)

    def _logprobs(self, entries: list) -> H.ChatLogprobs | H.CompletionLogprobs | None:
        if not self.logprobs:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, self.top_k)

    def chunk(self, part: ChoiceDelta, created: int) -> H.ChatCompletionChunk | H.CompletionResponse:
        """One server-sent event's body for one delta."""
        if self.chat:
            delta = H.DeltaMessage(content=part.text, role="assistant" if part.first else None)
            return H.ChatCompletionChunk(id=self.id, created=created, model=self.model, choices=[
                H.ChatChunkChoice(index=part.index, delta=delta, finish_reason=part.finish_reason,
                                  logprobs=self._logprobs(part.logprobs))])
        return H.CompletionResponse(id=self.id, created=created, model=self.model, choices=[
            H.CompletionChoice(index=part.index, text=part.text, finish_reason=part.finish_reason,
                               logprobs=self._logprobs(part.logprobs))])

    def usage_chunk(self, created: int) -> H.ChatCompletionChunk | H.CompletionResponse:
        """The stream's last event when the client asked for `stream_options.include_usage`."""
        cls = H.ChatCompletionChunk if self.chat else H.CompletionResponse
        return cls(id=self.id, created=created, model=self.model, choices=[], usage=self.usage())

    def response(self, created: int) -> H.ChatCompletionResponse | H.CompletionResponse:
        """The whole answer (needs keep=True): every choice that had output, in index order."""
        indexes = sorted(self.texts)
        if self.chat:
            return H.ChatCompletionResponse(id=self.id, created=created, model=self.model, usage=self.usage(),
                                            choices=[H.ChatChoice(
                                                index=i, message=H.ResponseMessage(content="".join(self.texts[i])),
                                                finish_reason=self.finish[i],
                                                logprobs=self._logprobs(self.entries.get(i, [])))
                                                for i in indexes])
        return H.CompletionResponse(id=self.id, created=created, model=self.model, usage=self.usage(),
                                    choices=[H.CompletionChoice(
                                        index=i, text="".join(self.texts[i]), finish_reason=self.finish[i],
                                        logprobs=self._logprobs(self.entries.get(i, [])))
                                        for i in indexes])

