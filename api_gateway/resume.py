"""What a request's choices have produced, and whether a new engine can continue them exactly.

Pure (no I/O). ``RequestRun`` (sequences.py) keeps one ``Choice`` per
(prompt, choice) of a request, fed with every delta it passes on; when the
engine restarts mid-request, ``plan`` says what to send the new one: a prompt
nothing of which has come out yet is sent again as it was (all its choices,
echo and all); every other unfinished choice is continued on its own
(``Generate.resume``: its output so far as token ids, the characters of text
the client has), or, where vLLM cannot continue it exactly, restarted from
scratch if the client saw none of it (a whole answer, not sent yet) and
otherwise not at all (the request fails: an SSE error event).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from servectl.wire import engine as EP

# Request fields a continued request reproduces exactly: what the prompt is made of, what
# vLLM computes per step from the logits and the tokens so far, prompt and output alike
# (repetition_penalty), what the engine counts down (max_tokens, min_tokens), how output
# stops and is shown. A field not named here (bad_words, repetition_detection, a thinking
# budget, custom logits processors, watermarking: they look at the output so far) is not.
EXACT = frozenset({
    "model", "prompt", "messages", "suffix", "add_special_tokens", "add_generation_prompt", "continue_final_message",
    "chat_template", "chat_template_kwargs", "documents", "reasoning_effort", "truncate_prompt_tokens",
    "truncation_side", "cache_salt",
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logit_bias", "allowed_token_ids",
    "n", "max_tokens", "max_completion_tokens", "min_tokens",
    "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "logprobs", "top_logprobs", "logprob_token_ids", "prompt_logprobs", "echo", "return_token_ids",
    "return_tokens_as_token_ids", "return_prompt_text", "skip_special_tokens", "spaces_between_special_tokens",
    "include_reasoning", "stream", "stream_options", "stream_interval", "user", "priority", "request_id",
    "session_id", "parallel_tool_calls", "tools", "tool_choice",
    # exact for some values only (why_not_exact):
    "seed", "presence_penalty", "frequency_penalty", "response_format", "structured_outputs",
})


# The same for the requests vLLM's serving classes take whole (Responses, Messages: the fields
# they become in vLLM's sampling and prompt; a format in `text` / `output_config` is a grammar,
# which the engine reports as ``constrained``). Not named: watermarking, vllm_xargs.
EXACT_API = {
    "responses": frozenset({
        "model", "input", "instructions", "max_output_tokens", "metadata", "logit_bias", "parallel_tool_calls",
        "previous_response_id", "prompt", "reasoning", "include_reasoning", "service_tier", "store", "stream",
        "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "top_k", "min_p", "truncation", "user",
        "skip_special_tokens", "include_stop_str_in_output", "prompt_cache_key", "request_id", "session_id",
        "priority", "cache_salt", "enable_response_messages", "previous_input_messages", "repetition_penalty",
        "stop", "stop_token_ids", "ignore_eos", "chat_template_kwargs", "include", "max_tool_calls",
        "seed", "presence_penalty", "frequency_penalty", "structured_outputs", "text",
    }),
    "messages": frozenset({
        "model", "messages", "max_tokens", "metadata", "stop_sequences", "stream", "system", "temperature",
        "tool_choice", "tools", "top_k", "top_p", "cache_salt", "chat_template_kwargs", "output_config",
        "thinking",  # exact unless it sets a budget (why_not_exact)
    }),
}


def why_not_exact(gen: EP.Generate, constrained: bool = False) -> str | None:
    """Why a new engine could not continue this request's output exactly, or None if it can.
    ``constrained``: the engine said a grammar constrains it (a `required` or named tool choice,
    a strict tool's structural tag: set by the model's tool-call parser, not seen in the body)."""
    b = gen.body
    if constrained:
        return "constrained output (the grammar's state is not carried over)"
    rf = b.get("response_format")
    if b.get("structured_outputs") is not None or (isinstance(rf, dict) and rf.get("type") not in (None, "text")):
        return "structured output (the grammar's state is not carried over)"
    thinking = b.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return "a thinking budget (it counts the output so far)"
    for name in ("presence_penalty", "frequency_penalty"):
        if b.get(name):
            return f"{name} (it counts output tokens only; continued output would be prompt)"
    temperature = b.get("temperature")
    if b.get("seed") is not None and (temperature is None or temperature > 0):
        return "seeded sampling (the sampler's random state is not carried over)"
    exact = EXACT_API.get(gen.kind, EXACT)
    unknown = sorted(k for k, v in b.items() if k not in exact and v is not None)
    if unknown:
        return f"{unknown[0]} (not known to continue exactly)"
    return None


# Kinds a new engine runs again from their input rather than continuing: vLLM's speech serving
# asks the engine several times a request (engine_core/speech_apis.py); a whole answer is sent
# again, a stream the client has seen part of cannot go on.
FROM_THE_START = frozenset({"transcription", "translation"})


@dataclass
class Choice:
    tokens: list[int] = field(default_factory=list)  # output token ids passed on, in order
    text_chars: int = 0  # characters of output text passed on (echo not counted)
    started: bool = False  # a delta of it was passed on
    finished: bool = False
    # Responses / Messages: the deltas passed on, as they came (what the engine's serving code is
    # fed again to go on: Resume.deltas); None where not kept.
    deltas: list[EP.ReplayedDelta] | None = None


class CannotContinue(Exception):
    """A choice the client has seen part of cannot be continued exactly."""


def plan(gens: list[EP.Generate], choices: list[list[Choice]], new_id, whole_answer: bool,
         restart, constrained: list[bool] | None = None) -> list[tuple[int, EP.Generate]]:
    """What to send a new engine for the unfinished part of a request: (prompt index, Generate).

    ``restart(pi, c)`` is called for a choice that runs again from the start (its partial
    output must be forgotten); ``whole_answer`` says the client has seen nothing yet.
    Raises ``CannotContinue`` for a streamed choice that cannot go on exactly.
    """
    out = []
    for pi, gen in enumerate(gens):
        mine = choices[pi]
        if all(c.finished for c in mine):
            continue
        if gen.kind in FROM_THE_START and any(c.started for c in mine):
            if not whole_answer:
                raise CannotContinue("speech to text (its calls start again from the audio)")
            for index, c in enumerate(mine):
                if c.started:
                    restart(pi, index)
                mine[index] = Choice(deltas=[] if c.deltas is not None else None)
        if not any(c.started for c in mine):
            again = copy.copy(gen)  # nothing of this prompt came out: as it was, all its choices
            again.request_id = new_id()
            out.append((pi, again))
            continue
        reason = why_not_exact(gen, bool(constrained and constrained[pi]))
        for index, c in enumerate(mine):
            if c.finished:
                continue
            if c.tokens and reason is not None:
                if not whole_answer:
                    raise CannotContinue(reason)
                restart(pi, index)
                mine[index] = c = Choice(deltas=[] if c.deltas is not None else None)
            resumed = copy.copy(gen)  # the engine shows no prompt (echo) for it: the client has it
            resumed.request_id = new_id()
            resumed.resume = EP.Resume(index=index, token_ids=list(c.tokens), text_chars=c.text_chars,
                                       deltas=list(c.deltas or ()))
            out.append((pi, resumed))
    return out
