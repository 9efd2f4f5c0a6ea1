"""The seam of a resumed choice's text, with vLLM's own detokenizer and the bundled tokenizer.

An engine lifetime detokenizes a choice and holds text back while checking stop
strings; it dies; the next one gets the prompt plus the output tokens and is
seeded (engine_core/resume.py). What the client receives in all must be what
one uninterrupted lifetime gives: held text not lost, nothing repeated, and a
stop string that spans the seam still stops at the same place. No engine, no
daemon: the detokenizers are driven as vLLM's output processor drives them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from servectl.config import DEFAULT_MODEL_DIR
from servectl.wire import engine as EP

pytestmark = pytest.mark.vllm_unit  # vLLM's detokenizer, no daemon

TEXT = "def parse(self, data):\n    return self.parser.parse(data) or None  # é ünïcode 💥 end\n"


@pytest.fixture(scope="module")
def tok():
    from vllm.tokenizers.registry import get_tokenizer

    return get_tokenizer(str(DEFAULT_MODEL_DIR))


def detokenizer(tok, prompt: list[int], stop: list[str], include: bool = False):
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=100)
    return IncrementalDetokenizer.from_new_request(tok, SimpleNamespace(
        request_id="r", sampling_params=params, prompt_token_ids=prompt, prompt_embeds=None))


def deliver(d, tokens: list[int]) -> tuple[str, str | None, int]:
    """Feed tokens one per step as vLLM's output processor does: (text sent, stop matched, tokens used)."""
    out = []
    for i, t in enumerate(tokens):
        stop = d.update([t], False)
        out.append(d.get_next_output_text(stop is not None, True))
        if stop is not None:
            return "".join(out), stop, i + 1
    return "".join(out), None, len(tokens)


def resumed_run(tok, prompt, tokens, stop, crash_after: int, include: bool = False):
    from engine_core.resume import seed_detokenizer

    first, matched, used = deliver(detokenizer(tok, prompt, stop, include), tokens[:crash_after])
    assert matched is None, "the stop came before the crash"
    resume = EP.Resume(token_ids=tokens[:crash_after], text_chars=len(first))
    d2 = detokenizer(tok, prompt + tokens[:crash_after], stop, include)
    engine = SimpleNamespace(output_processor=SimpleNamespace(request_states={"r2": SimpleNamespace(detokenizer=d2)}))
    assert seed_detokenizer(engine, "r2", tok, prompt, resume)
    rest, matched, used = deliver(d2, tokens[crash_after:])
    return first + rest, matched, crash_after + used


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_spanning_the_seam_stops_where_it_would_have(tok, include):
    prompt = tok.encode("# a helper\n")
    tokens = tok.encode(TEXT, add_special_tokens=False)
    stop = ["self.parser.parse("]
    reference, matched, used = deliver(detokenizer(tok, prompt, stop, include), tokens)
    assert matched == stop[0]
    # Crash at every point before the stop completes: the seam falls inside the stop string,
    # inside the held-back text, and before either.
    for crash in range(1, used):
        got, got_matched, got_used = resumed_run(tok, prompt, tokens, stop, crash, include)
        assert (got, got_matched, got_used) == (reference, matched, used), crash


@pytest.mark.parametrize("stop", [[], ["never appears in the text", "\n\n\n"]])
def test_held_back_text_is_not_lost_and_split_characters_come_out_once(tok, stop):
    prompt = tok.encode("x = ")
    tokens = tok.encode(TEXT, add_special_tokens=False)
    reference, matched, _ = deliver(detokenizer(tok, prompt, stop), tokens)
    assert matched is None and (stop or reference == TEXT)
    # Crashes everywhere, inside the multi-byte characters too.
    for crash in range(1, len(tokens)):
        got, _, _ = resumed_run(tok, prompt, tokens, stop, crash)
        assert got == reference, crash  # the same text, held-back part (not flushed: no finish) alike
