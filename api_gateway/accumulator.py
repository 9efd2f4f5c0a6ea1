"""One response, built from the engine's deltas, for streamed and whole answers alike.

The engine sends, per step, one ``Delta`` per choice of each request: new
text, token ids, logprob entries, a finish and stop reason, and on a request's
first delta its ``PromptInfo`` (token count and ids, echo, prompt logprobs,
the chat role). ``ResponseAccumulator.add`` is the one place that reads a
delta: it counts usage, notes the first token's time, puts the echo in front of
a choice's first output and maps (prompt, choice) to the response's choice
index. A stream turns each result into chunks (``chunks``) the way vLLM's
server does — a chat stream opens with a role chunk per choice, then its echo —
and a whole response keeps them for ``response()``. Pure: no I/O, clock injectable.
"""

from __future__ import annotations

import time
from typing import Callable

import msgspec

from api_gateway import openai_types as H
from api_gateway.translate import chat_logprobs, completion_logprobs
from servectl.wire.engine import Delta, PromptInfo


class ChoiceDelta:
    """What one delta adds to one choice of the response."""

    __slots__ = ("pi", "index", "text", "entries", "token_ids", "finish_reason", "stop_reason", "first",
                 "opens_request", "empty", "message")

    def __init__(self, pi: int, index: int, text: str, entries: list, token_ids: list[int],
                 finish_reason: str | None, stop_reason, first: bool, opens_request: bool, empty: bool,
                 message: dict | None = None):
        self.pi = pi  # the prompt (engine request) it belongs to
        self.index = index  # the choice's index in the response: prompt index * n + choice
        self.text = text  # with the echo in front on a completion choice's first delta
        self.entries = entries  # logprob entries of this delta's tokens (a completion's echoed prompt first)
        self.token_ids = token_ids  # the generated tokens (never the echoed prompt's)
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.first = first  # the choice's first delta
        self.opens_request = opens_request  # the request's first delta (it carried the PromptInfo)
        self.empty = empty  # nothing to show (vLLM sends no chunk for it)
        self.message = message  # a parsed chat's delta fields (vLLM's), None for a plain one


class _Choice:
    __slots__ = ("texts", "entries", "token_ids", "finish", "stop_reason", "tokens", "offset", "message",
                 "reasoning_tokens")

    def __init__(self):
        self.message: dict | None = None  # a parsed whole answer's message fields (vLLM's)
        self.reasoning_tokens = 0
        self.texts: list[str] = []
        self.entries: list = []
        self.token_ids: list[int] = []
        self.finish: str | None = None
        self.stop_reason = None
        self.tokens = 0  # generated so far (continuous usage)
        self.offset = 0  # completions logprobs: text offset of the next token


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
        self.n = req.n or 1
        # Chat: logprobs is a bool; completions: the number of alternatives, or None for none.
        self.logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        self.echo_only = not chat and bool(req.echo) and req.max_tokens == 0
        self.return_token_ids = bool(req.return_token_ids)
        opts = req.stream_options
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        self.id = response_id
        self.keep = keep
        self.clock = clock
        self.prompt_tokens = [0] * prompts
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.infos: dict[int, PromptInfo] = {}  # prompt index -> its PromptInfo
        self.choices: dict[int, _Choice] = {}

    def add(self, pi: int, d: Delta) -> ChoiceDelta:
        """Account for one delta of prompt ``pi``'s request."""
        if d.token_ids:
            if self.first_token_at is None:
                self.first_token_at = self.clock()
            self.completion_tokens += len(d.token_ids)
        opens = d.prompt is not None
        if opens:
            self.infos[pi] = d.prompt
            self.prompt_tokens[pi] = d.prompt.tokens
        index = pi * self.n + d.index
        first = index not in self.choices
        choice = self.choices.setdefault(index, _Choice())
        choice.tokens += len(d.token_ids)
        text, entries = d.text, d.logprobs or []
        info = self.infos.get(pi)
        if first and not self.chat and info is not None and info.echo_text is not None:
            if self.echo_only:  # the prompt only: the one token vLLM generated for it is not shown
                text, entries = info.echo_text, info.echo_logprobs or []
            else:
                text, entries = info.echo_text + text, (info.echo_logprobs or []) + entries
        elif self.echo_only:
            text, entries = "", []
        if self.keep:
            choice.texts.append(text)
            choice.entries.extend(entries)
            choice.token_ids.extend(d.token_ids)
        if d.finish_reason is not None:
            choice.finish, choice.stop_reason = d.finish_reason, d.stop_reason
        if d.reasoning_tokens is not None:
            choice.reasoning_tokens = d.reasoning_tokens
        if info is not None and info.parsed:  # what vLLM's parsers show (Delta.message), not the raw text
            if d.message is not None:
                choice.message = d.message
            shows_ids = self.return_token_ids and not info.metadata_hidden
            empty = d.message is None and d.finish_reason is None and not entries and not (shows_ids and d.token_ids)
            return ChoiceDelta(pi, index, text, entries, d.token_ids, d.finish_reason, d.stop_reason, first, opens,
                               empty, d.message or {})
        empty = not text and not d.token_ids and d.finish_reason is None and not entries
        return ChoiceDelta(pi, index, text, entries, d.token_ids, d.finish_reason, d.stop_reason, first, opens,
                           empty)

    def restart(self, pi: int, choice: int) -> None:
        """Forget what one choice had: it runs again from its start (a whole answer whose engine
        restarted where it could not be continued exactly; the client saw none of it). Its
        echo comes again with its new first delta."""
        old = self.choices.pop(pi * self.n + choice, None)
        if old is not None:
            self.completion_tokens -= old.tokens

    def _details(self, reasoning_tokens: int, null: bool = False):
        """vLLM's ``completion_tokens_details`` (a model with a reasoning parser), else unset, or
        null where vLLM sets it anyway (a chat stream's running usage)."""
        if any(info.reasoning_usage for info in self.infos.values()):
            return H.CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return None if null else msgspec.UNSET

    def so_far(self) -> tuple[int, int]:
        """(prompt, completion) tokens of what came so far: an answer that ends early still used them."""
        return sum(self.prompt_tokens), self.completion_tokens

    def usage(self, whole: bool = False) -> H.Usage:
        """The answer's usage; a whole body's writes the details vLLM's model_dump does, null or not."""
        prompt = sum(self.prompt_tokens)
        details = self._details(sum(c.reasoning_tokens for c in self.choices.values()))
        return H.Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                       total_tokens=prompt + self.completion_tokens,
                       prompt_tokens_details=None if whole else msgspec.UNSET,
                       completion_tokens_details=None if whole and details is msgspec.UNSET else details)

    def _choice_usage(self, pi: int, index: int) -> H.Usage | None:
        if not self.continuous_usage:
            return None
        choice = self.choices.get(index)
        prompt, done = self.prompt_tokens[pi], choice.tokens if choice else 0
        return H.Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done,
                       completion_tokens_details=self._details(choice.reasoning_tokens if choice else 0,
                                                               null=self.chat))

    # ---- a stream ------------------------------------------------------------------------------
    def chunks(self, part: ChoiceDelta, created: int) -> list[H.ChatCompletionChunk | H.CompletionResponse]:
        """The server-sent events' bodies for one delta (none for an empty one)."""
        out: list = []
        info = self.infos.get(part.pi)
        if self.chat and part.opens_request:
            out.extend(self._chat_openers(info, created))
        if part.empty:
            return out
        if self.chat:
            # A parsed chat whose reasoning is hidden shows neither (vLLM's hide_stream_metadata).
            shown = not (part.message is not None and info.metadata_hidden)
            delta = H.DeltaMessage(content=part.text) if part.message is None else \
                msgspec.convert(part.message, H.DeltaMessage)
            logprobs = chat_logprobs(part.entries) if self.logprobs and shown else None
            shows_ids = self.return_token_ids and shown
            out.append(H.ChatCompletionChunk(
                id=self.id, object="chat.completion.chunk", created=created, model=self.model,
                usage=self._choice_usage(part.pi, part.index), choices=[H.ChatChunkChoice(
                    index=part.index, delta=delta, logprobs=logprobs,
                    finish_reason=part.finish_reason,
                    stop_reason=msgspec.UNSET if part.finish_reason is None else part.stop_reason,
                    token_ids=part.token_ids if shows_ids else None)]))
            return out
        logprobs = None
        if self.logprobs:
            choice = self.choices[part.index]
            logprobs, choice.offset = completion_logprobs(part.entries, choice.offset)
        choice_data = H.CompletionChoice(
            index=part.index, text=part.text, logprobs=logprobs, finish_reason=part.finish_reason,
            stop_reason=part.stop_reason, token_ids=part.token_ids if self.return_token_ids else None,
            # vLLM's stream sends the prompt's ids with a choice's first chunk under return_token_ids,
            # and with an echo even without it (the engine sends them in both cases).
            prompt_token_ids=info.token_ids if part.first and info else None)
        out.append(H.CompletionResponse(id=self.id, object="text_completion", created=created, model=self.model,
                                        choices=[choice_data], usage=self._choice_usage(part.pi, part.index)))
        return out

    def _chat_openers(self, info: PromptInfo, created: int) -> list[H.ChatCompletionChunk]:
        """vLLM's first chunks of a chat stream: the role of every choice, then every choice's echo."""
        usage = H.Usage(prompt_tokens=info.tokens, completion_tokens=0, total_tokens=info.tokens,
                        completion_tokens_details=self._details(0, null=True)) if self.continuous_usage else None
        out = [H.ChatCompletionChunk(
            id=self.id, object="chat.completion.chunk", created=created, model=self.model, usage=usage,
            prompt_token_ids=info.token_ids if self.return_token_ids else None, prompt_text=info.prompt_text,
            choices=[H.ChatChunkChoice(index=i, delta=H.DeltaMessage(role=info.role or "assistant", content=""),
                                       logprobs=None, finish_reason=None)]) for i in range(self.n)]
        if info.echo_text:
            out.extend(H.ChatCompletionChunk(
                id=self.id, object="chat.completion.chunk", created=created, model=self.model, usage=usage,
                choices=[H.ChatChunkChoice(index=i, delta=H.DeltaMessage(content=info.echo_text), logprobs=None,
                                           finish_reason=None)]) for i in range(self.n))
        return out

    def usage_chunk(self, created: int) -> H.ChatCompletionChunk | H.CompletionResponse:
        """The stream's last event when the client asked for `stream_options.include_usage`."""
        if self.chat:
            return H.ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=created,
                                         model=self.model, choices=[], usage=self.usage())
        return H.CompletionResponse(id=self.id, object="text_completion", created=created, model=self.model,
                                    choices=[], usage=self.usage())

    @staticmethod
    def _message(info: PromptInfo, c: _Choice) -> H.ResponseMessage:
        """A choice's message: its text, or a parsed chat's fields as vLLM's parsers gave them; an
        echo in front of the content."""
        role, echo = info.role or "assistant", info.echo_text or ""
        if not info.parsed:
            return H.ResponseMessage(role=role, content=echo + "".join(c.texts))
        m = c.message or {}
        content = m.get("content")
        calls = m.get("tool_calls")
        return H.ResponseMessage(role=role, content=echo + (content or "") if echo else content,
                                 reasoning=m.get("reasoning"),
                                 tool_calls=msgspec.convert(calls, list[H.ToolCall]) if calls else msgspec.UNSET)

    # ---- a whole response ------------------------------------------------------------------------
    def response(self, created: int) -> H.ChatCompletionResponse | H.CompletionResponse:
        """The whole answer (needs keep=True): every choice that had output, in index order."""
        ids = self.return_token_ids
        if self.chat:
            info = self.infos.get(0) or PromptInfo(tokens=0)
            hidden = info.metadata_hidden
            return H.ChatCompletionResponse(
                id=self.id, object="chat.completion", created=created, model=self.model, usage=self.usage(whole=True),
                prompt_logprobs=info.prompt_logprobs, prompt_token_ids=info.token_ids if ids else None,
                prompt_text=info.prompt_text, choices=[H.ChatChoice(
                    index=i, message=self._message(info, c),
                    logprobs=chat_logprobs(c.entries) if self.logprobs and not hidden else None,
                    finish_reason=c.finish or "stop", stop_reason=c.stop_reason,
                    token_ids=c.token_ids if ids and not hidden else None)
                    for i, c in sorted(self.choices.items())])
        choices = []
        for i, c in sorted(self.choices.items()):
            info = self.infos.get(i // self.n) or PromptInfo(tokens=0)
            choices.append(H.CompletionChoice(
                index=i, text="".join(c.texts), logprobs=completion_logprobs(c.entries)[0] if self.logprobs else None,
                finish_reason=c.finish, stop_reason=c.stop_reason, token_ids=c.token_ids if ids else None,
                prompt_logprobs=info.prompt_logprobs, prompt_token_ids=info.token_ids if ids else None,
                routed_experts=None))
        return H.CompletionResponse(id=self.id, object="text_completion", created=created, model=self.model,
                                    choices=choices, usage=self.usage(whole=True), service_tier=None,
                                    system_fingerprint=None, kv_transfer_params=None, ec_transfer_params=None,
                                    metrics=None)
