"""Speech to text: vLLM's transcription and translation serving classes, run inside the engine.

`vllm serve` answers ``/v1/audio/transcriptions`` and ``/v1/audio/translations``
with ``OpenAIServingTranscription`` / ``OpenAIServingTranslation`` when the
model supports transcription (Whisper and its kin). Here the same classes are
driven as the Responses and Messages ones are (serving_apis.py, driven.py),
with their two waits that are not the engine's feed made synchronous: the
audio's decoding and chunking (vLLM runs it on a thread pool) and the
rendering of the encoder-decoder prompts (``render_cmpl_async``).

One request may ask the engine more than once, one after the other: Whisper's
language detection when no ``language`` is given (one token), then one
generation per 30-second window of the audio. vLLM merges the windows'
outputs with tasks on an event loop; here they run in order
(``sequential_merge``), each window added to vLLM once the one before it has
finished (serving_apis.py ``ApiRequest.next_built``), and vLLM assembles the
text by window as it does.

The gateway sends the upload's bytes in the request body (``file``), bounded
by ``max_body_bytes``; vLLM's own limits apply inside
(``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``, decode duration and bytes).
"""

from __future__ import annotations

import io
from typing import Any

KINDS = ("transcription", "translation")


async def sequential_merge(*iterators):
    """vLLM's ``merge_async_iterators`` without an event loop: each iterator to its end, in order."""
    for i, it in enumerate(iterators):
        async for item in it:
            yield i, item


def _synchronous(fn):
    async def run(*args, **kwargs):
        return fn(*args, **kwargs)
    return run


class _SyncCmplRenderer:
    """The engine's renderer with ``render_cmpl_async`` done synchronously (no event loop here)."""

    def __init__(self, renderer):
        self._renderer = renderer

    def __getattr__(self, name):
        return getattr(self._renderer, name)

    async def render_cmpl_async(self, prompts, tok_params=None, *, prompt_extras=None, skip_mm_cache=False):
        return self._renderer.render_cmpl(prompts, tok_params, prompt_extras=prompt_extras,
                                          skip_mm_cache=skip_mm_cache)


class SpeechApis:
    """One model's transcription and translation serving classes, as `vllm serve` builds them."""

    def __init__(self, client, models):
        import vllm.entrypoints.speech_to_text.base.serving as base
        from vllm.entrypoints.speech_to_text.transcription.serving import OpenAIServingTranscription
        from vllm.entrypoints.speech_to_text.translation.serving import OpenAIServingTranslation

        base.merge_async_iterators = sequential_merge  # this process runs vLLM's serving code only here
        self.serving = {
            "transcription": OpenAIServingTranscription(client, models, request_logger=None),
            "translation": OpenAIServingTranslation(client, models, request_logger=None),
        }
        for serving in self.serving.values():
            serving.renderer = _SyncCmplRenderer(serving.renderer)
            serving._decode_and_chunk_speech_async = _synchronous(serving._decode_and_chunk_speech)

    def create(self, kind: str, body: dict[str, Any]):
        """The serving coroutine for one request: ``body`` is the form's fields, ``file`` its bytes."""
        from starlette.datastructures import UploadFile
        from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionRequest
        from vllm.entrypoints.speech_to_text.translation.protocol import TranslationRequest

        fields = dict(body)
        audio = fields.pop("file", b"") or b""
        name = fields.pop("filename", None) or "audio"
        fields["file"] = UploadFile(io.BytesIO(audio), filename=name, size=len(audio))
        cls = TranscriptionRequest if kind == "transcription" else TranslationRequest
        request = cls.model_validate(fields)
        serving = self.serving[kind]
        if kind == "transcription":
            return serving.create_transcription(audio, request, None)
        return serving.create_translation(audio, request, None)
