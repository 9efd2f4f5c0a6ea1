"""Continuing a choice another engine lifetime started (``Generate.resume``).

The gateway sends the request as it came, plus the output the client already
has: its token ids and how many characters of its text were delivered. The
engine builds it as any other (vLLM's request class, defaults, rendering and
``max_tokens`` sizing, for the client's prompt), then makes it the
continuation: the prompt is the rendered one followed by those tokens (token
ids, nothing re-tokenised), with what is left of ``max_tokens`` /
``min_tokens`` and n = 1 (each unfinished choice resumes on its own, with the
seed vLLM's parallel sampling gives that choice), no prompt logprobs and no
echo. Its deltas carry the choice's index and no prompt information (the
client has it).

Text. The new request's detokenizer would start from scratch at the seam:
a character whose bytes the crash split between two tokens would come out
wrong, text held back while checking stop strings (up to the longest stop
string minus one character) would be lost, and a stop string spanning the
seam would not stop. So the old lifetime's detokenizer is replayed (vLLM's
own, primed with the prompt, fed the output tokens) and its state moves into
the new request's, with the offset the client reached: decoding goes on as
if nothing happened, the held text is emitted first, and the stop check
looks across the seam exactly as it did before the restart.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from servectl.wire import engine as P

log = logging.getLogger("engine_core.resume")


class ResumeError(ValueError):
    pass


def continued_params(n: int, max_tokens: int | None, min_tokens: int, seed: int | None,
                     resume: P.Resume) -> dict[str, Any]:
    """The sampling parameters that change when one choice continues. Pure."""
    done = len(resume.token_ids)
    if not 0 <= resume.index < max(n, 1):
        raise ResumeError(f"resume index {resume.index} outside the request's n={n}")
    out: dict[str, Any] = {"n": 1}
    if max_tokens is not None:
        if done >= max_tokens:
            raise ResumeError(f"nothing left to generate: {done} of max_tokens={max_tokens} already")
        out["max_tokens"] = max_tokens - done
    if min_tokens:
        out["min_tokens"] = max(0, min_tokens - done)
    if n > 1 and seed is not None:
        out["seed"] = seed + resume.index  # the seed vLLM's ParentRequest gives child `index`
    return out


def continue_request(built, resume: P.Resume) -> list[int]:
    """Make a freshly built request (engine_core/request_types.py ``Built``: vLLM's validation and
    defaults, the prompt rendered) the continuation of one of its choices. Returns the client's
    prompt's token ids."""
    engine_input = built.engine_input
    # A prompt with media (vLLM's "multimodal" input) continues as text does: its placeholders
    # stay where they are in the prompt, the output so far follows them.
    if not isinstance(engine_input, dict) or engine_input.get("type", "token") not in ("token", "multimodal") \
            or "prompt_token_ids" not in engine_input:
        raise ResumeError("only a prompt of token ids (with or without media) can be continued")
    prompt = list(engine_input["prompt_token_ids"])
    params = built.params
    for name, value in continued_params(params.n, params.max_tokens, params.min_tokens or 0, params.seed,
                                        resume).items():
        setattr(params, name, value)
    params.prompt_logprobs = None  # the prompt was shown already
    if hasattr(params, "skip_reading_prefix_cache"):
        params.skip_reading_prefix_cache = False
    # The new prompt: the old one and the output so far (offsets and text no longer match it).
    built.engine_input = {**{k: v for k, v in engine_input.items() if k not in ("prompt_token_offsets", "prompt")},
                          "prompt_token_ids": prompt + list(resume.token_ids)}
    spec = built.spec
    spec.echo = spec.echo_only = False
    return prompt


def seed_detokenizer(engine, request_id: str, tokenizer, prompt_ids: list[int], resume: P.Resume) -> list[str]:
    """Give the new request's detokenizer the old one's state: its text, its decoding position,
    and the offset the client reached in that text.

    The old lifetime's detokenizer is replayed (primed with the old prompt, fed the output
    tokens one at a time, as vLLM did) and its decoding state moves into the new request's: a
    character whose bytes the crash split between two tokens comes out whole, once, and text
    held back for stop strings comes first. Returns each output token's text as the client
    got it (cut at ``text_chars``: a chat parser replays them, chat_parsing.py); the state is
    not moved when vLLM's internals are not the expected ones (said in the log).
    """
    if not resume.token_ids:
        return []
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    state = getattr(getattr(engine, "output_processor", None), "request_states", {}).get(request_id)
    detok = getattr(state, "detokenizer", None)
    # No stop strings in the replay: none matched before the restart, or it would have finished.
    params = SimpleNamespace(stop=None, min_tokens=0, include_stop_str_in_output=False,
                             skip_special_tokens=getattr(detok, "skip_special_tokens", True),
                             spaces_between_special_tokens=getattr(detok, "spaces_between_special_tokens", True))
    replay = IncrementalDetokenizer.from_new_request(tokenizer, SimpleNamespace(
        request_id=request_id, sampling_params=params, prompt_token_ids=list(prompt_ids), prompt_embeds=None))
    texts = []
    for token in resume.token_ids:
        before = len(replay.output_text)
        replay.update([token], False)
        texts.append(replay.output_text[before:])
    text = replay.output_text
    shown, cut = [], resume.text_chars
    for piece in texts:
        shown.append(piece[:max(cut, 0)])
        cut -= len(piece)
    fast = hasattr(detok, "stream")
    slow = all(hasattr(detok, a) for a in ("tokens", "prefix_offset", "read_offset"))
    if not hasattr(detok, "output_text") or not hasattr(detok, "_last_output_text_offset") or not (fast or slow):
        log.warning("request %s: vLLM's detokenizer is not the expected one; the continued text may differ at "
                    "the seam", request_id)
        return shown
    if resume.text_chars > len(text):
        log.warning("request %s: the client has %d characters, the replay %d; not seeded", request_id,
                    resume.text_chars, len(text))
        return shown
    if fast:
        detok.stream = replay.stream
        if hasattr(replay, "last_special"):
            detok.last_special = replay.last_special
    else:
        detok.tokens, detok.prefix_offset, detok.read_offset = replay.tokens, replay.prefix_offset, replay.read_offset
    detok.output_text = text
    detok._last_output_text_offset = resume.text_chars
    return shown


def add_continued(engine, tokenizer, request_id: str, built, resume: P.Resume) -> None:
    """Add a freshly built request to vLLM as the continuation of one choice: its prompt and
    sampling made the continuation's (``continue_request``), the old detokenizer's state seeded
    into the new one and, for a parsed chat, the client's output replayed through its parser
    (for a Responses / Messages request, through its serving code: serving_apis.py).
    A failure after the request was made is not the client's: a 503, it cannot be continued."""
    from engine_core.request_types import BadRequest

    api = built.spec.api  # a Responses / Messages request: its serving code holds these parameters
    if api is not None:
        built.params = built.params.clone()
    prompt_ids = continue_request(built, resume)
    internal_id = built.add_to(engine, request_id)
    try:
        texts = seed_detokenizer(engine, internal_id, tokenizer, prompt_ids, resume)
        if api is not None:  # its serving code sees the client's output, delta by delta as it came
            api.replay(resume.deltas, prompt_ids)
        elif built.spec.parsing is not None:
            built.spec.parsing.replay(0, texts, list(resume.token_ids))
    except Exception as exc:
        log.exception("request %s: continuing its output failed", request_id)
        raise BadRequest(f"this answer cannot be continued on the restarted engine ({type(exc).__name__})",
                         status=503) from None

