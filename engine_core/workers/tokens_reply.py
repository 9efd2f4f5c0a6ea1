"""A step's reply as sampled tokens only, when that is all it holds (servectl/wire/worker.py).

``TokensReplyCodec(output_type)`` is given vLLM's ``ModelRunnerOutput`` (a
dataclass) by the worker and the engine; tests give it a stand-in of the same
shape, so this module imports no vLLM.

The one rule: ``encode`` returns bytes only for a value that ``decode`` turns
back into a value of the same type, equal under ``==`` (a dict's insertion
order aside: vLLM only looks ``req_id_to_index`` up by key), and None for
anything else (the caller then sends its signed pickle). A value qualifies
when it is exactly ``output_type``, its ``req_ids`` are ``str``s,
``req_id_to_index`` is their own order, ``sampled_token_ids`` is a list of
lists of ``int``s (one per request, or none at all) that msgpack can hold,
and every other field is at its default: None (or an empty dict, named in
the message) where the default is None, an empty container of the
default's type where the default is a factory, equal where it is a
constant. A field vLLM adds later is judged the same way; one without a
default turns the codec off (every reply a signed pickle), as does a type
that is not a dataclass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from servectl.wire import worker as WW

SENT = ("req_ids", "req_id_to_index", "sampled_token_ids")


class BadTokensReply(Exception):
    """An unsigned frame that is not a ``TokensReply``: dropped and counted like a bad signature."""


class TokensReplyCodec:
    def __init__(self, output_type: type):
        self.output_type = output_type
        # The fields not sent, by how each is told to be at its default (read once, off the step's path).
        none: list[str] = []  # default None (an empty dict is sent by name)
        empty: list[tuple[str, type]] = []  # a default factory: an empty container of that type
        equal: list[tuple[str, Any]] = []  # a constant default
        fields = dataclasses.fields(output_type) if dataclasses.is_dataclass(output_type) else ()
        self.usable = bool(fields) and set(SENT) <= {f.name for f in fields}  # the shape this message mirrors
        for f in fields:
            if f.name in SENT:
                continue
            if f.default is None:
                none.append(f.name)
            elif f.default_factory is not dataclasses.MISSING:
                made = f.default_factory()
                self.usable = self.usable and hasattr(made, "__len__") and len(made) == 0
                empty.append((f.name, type(made)))
            elif f.default is not dataclasses.MISSING:
                equal.append((f.name, f.default))
            else:
                self.usable = False  # a field with no default: it always has to be sent
        self.none_fields = frozenset(none)
        self._none, self._empty, self._equal = tuple(none), tuple(empty), tuple(equal)

    def encode(self, call_id: Any, value: Any) -> bytes | None:
        """The ``TokensReply`` bytes of a successful reply ``value``, or None: send it signed."""
        if not self.usable or type(value) is not self.output_type or type(call_id) is not int:
            return None
        empty_dicts: list[str] = []
        for name in self._none:
            v = getattr(value, name)
            if v is not None:
                if type(v) is not dict or v:
                    return None
                empty_dicts.append(name)
        for name, kind in self._empty:
            v = getattr(value, name)
            if type(v) is not kind or v:
                return None
        for name, default in self._equal:
            v = getattr(value, name)
            if type(v) is not type(default) or v != default:
                return None
        req_ids, index, sampled = value.req_ids, value.req_id_to_index, value.sampled_token_ids
        if type(req_ids) is not list or type(index) is not dict or type(sampled) is not list:
            return None
        if len(index) != len(req_ids):
            return None
        for i, rid in enumerate(req_ids):
            if type(rid) is not str or index.get(rid) != i:
                return None
        if sampled and len(sampled) != len(req_ids):  # (none at all: a step that sampled nothing)
            return None
        for tokens in sampled:
            if type(tokens) is not list:
                return None
            for t in tokens:
                if type(t) is not int:
                    return None
        try:
            return WW.encoder.encode(WW.TokensReply(call_id, req_ids, sampled, empty_dicts))
        except (OverflowError, UnicodeEncodeError, msgspec.EncodeError, TypeError):
            return None  # an int past msgpack's 64 bits, a lone surrogate in an id: the pickle takes it

    def decode(self, payload: bytes) -> tuple[int, bool, Any]:
        """``(call_id, True, output_type(...))`` from ``encode``'s bytes; BadTokensReply for anything else."""
        if not self.usable:
            raise BadTokensReply("an unsigned reply, and this engine takes none")
        try:
            msg = WW.decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadTokensReply(f"an unsigned reply that is not a TokensReply: {exc}") from None
        index = {rid: i for i, rid in enumerate(msg.req_ids)}
        if len(index) != len(msg.req_ids):
            raise BadTokensReply("an unsigned reply with a request id twice")
        if msg.sampled_token_ids and len(msg.sampled_token_ids) != len(msg.req_ids):
            raise BadTokensReply(f"an unsigned reply with {len(msg.sampled_token_ids)} requests' tokens "
                                 f"for {len(msg.req_ids)} requests")
        value = self.output_type(req_ids=msg.req_ids, req_id_to_index=index, sampled_token_ids=msg.sampled_token_ids)
        for name in msg.empty_dicts:
            if name not in self.none_fields:
                raise BadTokensReply(f"an unsigned reply with {name!r} as an empty dict")
            setattr(value, name, {})
        return msg.call_id, True, value
