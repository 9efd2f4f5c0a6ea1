"""The engine ⇄ worker hop's own vocabulary: servectl's call names, and the reply to a step
that carries nothing but sampled tokens.

Calls are vLLM's worker methods by name, plus two of servectl's own
(``EXECUTE_AND_SAMPLE``, ``STATS_METHOD``); both ends import them from here.

The hop carries signed pickles of vLLM's own objects
(engine_core/workers/signing.py), with one exception: a step's reply whose
``ModelRunnerOutput`` holds only request ids and sampled tokens (every
other field at its default: no logprobs, no pooler output, no connector
output) — the reply of nearly every decode step — travels as this struct,
msgpack-encoded and unsigned, and the engine rebuilds vLLM's
``ModelRunnerOutput`` from it (engine_core/workers/tokens_reply.py). Decoding it
runs no code from the message, so it needs no signature, as no other
msgspec hop in servectl does; skipping the pickle and the two HMACs takes
≈ 150 µs off every step's path on a 2-core CPU host (docs/decisions.md;
bench/results/2026-12-01-tokens-reply-ab.md).
Everything else on the hop, every call included, stays a signed pickle.

On the stream the struct's frame is marked by ``UNSIGNED_FLAG``
in its length (engine_core/workers/link.py).
"""

from __future__ import annotations

import msgspec

# execute_model, then sample_tokens(None) if it returned None: one round trip per step
# instead of two when no request needs a grammar (engine_core/workers/step_calls.py).
EXECUTE_AND_SAMPLE = "__servectl_execute_and_sample__"
# The worker's counters (rejected frames, rank, pid): what the tests ask a worker.
STATS_METHOD = "__servectl_stats__"
# The calls that are a model step (the overlap counter counts them).
STEP_METHODS = frozenset({"execute_model", EXECUTE_AND_SAMPLE})


class TokensReply(msgspec.Struct, array_like=True):
    """``(call_id, ok=True, ModelRunnerOutput(req_ids, req_id_to_index, sampled_token_ids, ...))``.

    ``req_id_to_index`` is not sent: it is ``req_ids``' own order (the encoder
    sends nothing else)."""

    call_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Fields whose default is None that were an empty dict (vLLM's runner sets
    # ``num_nans_in_logits = {}`` on every step it samples): rebuilt as {}.
    empty_dicts: list[str] = []


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(TokensReply)
