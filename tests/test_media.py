"""Issue 55: images and speech, served by the bundled models through vLLM's own code (real daemon,
real clients), and the same requests to `vllm serve` (same venv, model and flags; one at a time).

Pictures and speech are made fresh here, never from the training sets: shapes drawn with
training/train_vision_model.py's ``sample`` at seeds it never trained on, digit strings from the
held-out bucket of training/train_speech_model.py spoken by Debian's espeak-ng. One daemon for the
module (the vision and speech models); the worker kills come last in it.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import signal
import threading
import wave

import pytest

from bench.run import VllmServe
from conftest import (DEFAULT_MODEL_DIR, DaemonFactory, assert_nothing_running, http, requests_running, vllm_serving,
                      wait_for)

VISION_DIR = DEFAULT_MODEL_DIR.parent / "vision"
SPEECH_DIR = DEFAULT_MODEL_DIR.parent / "speech"
MAX_MEDIA_BYTES = 300_000
MEDIA_HOST = "images.example.com"  # URLs are fetched from it alone (never reached: no test asks it)
MEDIA_CONFIG = f"""[manager]
warm_standby = false
[gateway]
max_media_bytes = {MAX_MEDIA_BYTES}
[[models]]
name = "vision"
model = "{VISION_DIR}"
[models.engine_args]
dtype = "float32"
allowed_media_domains = ["{MEDIA_HOST}"]
[[models]]
name = "speech"
model = "{SPEECH_DIR}"
[models.engine_args]
dtype = "float32"
"""
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def md(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "media") as make:
        yield make(MEDIA_CONFIG)


def picture(seed: int):
    """(a fresh picture's PNG bytes, its answer), e.g. "a red circle"."""
    from training.train_vision_model import sample

    img, answer = sample(random.Random(seed))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), answer


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_body(url: str, **extra) -> dict:
    return {"model": "vision", "temperature": 0, "max_tokens": 8, **extra, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": QUESTION}]}]}


def form(target, path: str, fields: dict, files: dict | None = None):
    """A multipart/form-data POST (what the openai SDK sends for audio), every status back."""
    boundary = "servectl-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    for name, (filename, data) in (files or {}).items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return http(target, "POST", path, body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})


def spoken(digits: str, lang: str, seed: int = 0) -> bytes:
    """A WAV (16 kHz, 16-bit) of the digits' words in ``lang``, spoken by espeak-ng as the speech
    model's held-out set is (a voice, speed, pitch and silence drawn from ``seed``)."""
    import numpy as np

    from training.train_speech_model import SR, utterance

    audio = utterance(random.Random(seed), lang, digits)["audio"]
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def fresh_digits(seed: int, n: int) -> list[str]:
    from training.train_speech_model import sample_digits

    rng = random.Random(seed)
    return [sample_digits(rng, want_held_out=True) for _ in range(n)]


# -- images -----------------------------------------------------------------------------------

def test_image_chats_whole_and_streamed_name_the_picture(md):
    client = md.openai()
    right, answers = 0, []
    for seed in range(9_000, 9_006):
        png, truth = picture(seed)
        body = chat_body(data_url(png))
        whole = client.chat.completions.create(**{k: v for k, v in body.items()})
        text = whole.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(**body, stream=True) if c.choices)
        assert streamed == text, (streamed, text)  # greedy: the same answer either way
        assert whole.usage.prompt_tokens > 10  # the picture's tokens are in the prompt
        right += text.strip() == truth
        answers.append((truth, text))
    assert right >= 5, answers  # the card's held-out accuracy is well above 5 of 6


def test_an_image_in_responses_and_in_messages(md):
    import anthropic

    png, truth = picture(9_100)
    r = md.openai().responses.create(model="vision", temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(png)},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text.strip() == truth, (r.output_text, truth)
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{md.port}", api_key="unused")
    m = claude.messages.create(model="vision", max_tokens=8, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert m.content[0].text.strip() == truth, (m.content, truth)


def test_hostile_media_is_a_4xx_and_the_engine_keeps_serving(md, tmp_path):
    from PIL import Image

    engine = md.child("engine_core:vision").pid
    png, truth = picture(9_200)

    def status(url: str) -> tuple[int, str]:
        r = http(md, "POST", "/v1/chat/completions", chat_body(url))
        return r.status, r.text

    code, text = status("http://127.0.0.1:9/x.png")  # not an allowed host: nothing is fetched
    assert code == 400 and MEDIA_HOST in text, text
    code, text = status("file:///etc/passwd")  # no allowed_local_media_path
    assert code == 400 and "allowed-local-media-path" in text, text
    code, text = status(data_url(png[: len(png) // 2]))  # a truncated PNG
    assert code == 400 and "truncated" in text, text
    code, text = status("data:image/png;base64,bm90IGFuIGltYWdl")  # not an image at all
    assert code == 400, text
    # A part without its URL makes pydantic-core panic inside vLLM's parser (a BaseException).
    r = http(md, "POST", "/v1/chat/completions", {"model": "vision", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": QUESTION}]}]})
    assert r.status == 400, r.text
    bomb = io.BytesIO()  # 20,000 x 20,000 pixels in a few KB: PIL's decompression-bomb check
    Image.new("1", (20_000, 20_000)).save(bomb, format="PNG", optimize=True)
    assert len(bomb.getvalue()) < MAX_MEDIA_BYTES
    code, text = status(data_url(bomb.getvalue()))
    assert code == 400 and "pixels" in text, text
    big = os.urandom(MAX_MEDIA_BYTES)  # more than the gateway takes inline: a 413 naming the limit
    code, text = status("data:image/png;base64," + base64.b64encode(big).decode())
    assert code == 413 and "max_media_bytes" in text, text
    # A WAV whose header claims an hour over a second of samples.
    wav = bytearray(spoken("12", "en"))
    wav[40:44] = (16_000 * 2 * 3600).to_bytes(4, "little")
    r = form(md, "/v1/audio/transcriptions", {"model": "speech"}, {"file": ("liar.wav", bytes(wav))})
    assert r.status in (200, 400), r.text  # read as far as it goes, or refused: never a 5xx
    # Nothing of it cost the engines a restart; the picture is still named.
    assert md.child("engine_core:vision").pid == engine
    assert http(md, "POST", "/v1/chat/completions", chat_body(data_url(png))).json()[
        "choices"][0]["message"]["content"].strip() == truth


def test_a_text_only_model_answers_a_picture_with_vllms_400(daemon):
    png, _ = picture(9_300)
    r = http(daemon, "POST", "/v1/chat/completions", {**chat_body(data_url(png)), "model": "default"})
    assert r.status == 400, r.text


# -- speech -----------------------------------------------------------------------------------

def test_transcriptions_and_translations_with_the_openai_sdk(md):
    from training.train_speech_model import words

    client = md.openai()
    right, seen = 0, []
    for i, (digits, lang) in enumerate(zip(fresh_digits(5_500, 4), ("en", "de", "en", "de"))):
        audio = spoken(digits, lang, seed=5_500 + i)
        got = client.audio.transcriptions.create(model="speech", file=("d.wav", audio), temperature=0).text
        right += got.strip() == words(digits, lang)
        seen.append((digits, lang, got))
        if lang == "de":  # Whisper's translate task: the English words
            tr = client.audio.translations.create(model="speech", file=("d.wav", audio), temperature=0).text
            right += tr.strip() == words(digits, "en")
            seen.append((digits, "translate", tr))
    assert right >= 5, seen  # of 6


def test_speech_formats_and_a_stream(md):

    audio = spoken(fresh_digits(6_000, 1)[0], "en", seed=6_000)
    client = md.openai()
    verbose = client.audio.transcriptions.create(model="speech", file=("d.wav", audio), language="en",
                                                 response_format="verbose_json", temperature=0)
    assert verbose.language == "en" and verbose.duration > 0.3, verbose
    chunks = list(client.audio.transcriptions.create(model="speech", file=("d.wav", audio), language="en",
                                                     temperature=0, stream=True))
    text = "".join((c.choices[0]["delta"].get("content") or "") for c in chunks if getattr(c, "choices", None))
    whole = client.audio.transcriptions.create(model="speech", file=("d.wav", audio), language="en",
                                               temperature=0).text
    assert text == whole and whole.strip(), (text, whole)  # streamed or whole, the same words
    # vLLM serves no srt / vtt: its 400, as `vllm serve` answers.
    r = form(md, "/v1/audio/transcriptions", {"model": "speech", "response_format": "srt"},
             {"file": ("d.wav", audio)})
    assert r.status == 400 and "response_format" in r.text, r.text
    r = form(md, "/v1/audio/transcriptions", {"model": "speech"}, {"file": ("d.wav", b"RIFF....not audio")})
    assert r.status == 400, r.text
    r = form(md, "/v1/audio/transcriptions", {"model": "speech"})  # no file
    assert r.status == 400 and "file" in r.text, r.text
    # Not a speech model: the route `vllm serve` would not have.
    r = form(md, "/v1/audio/transcriptions", {"model": "vision"}, {"file": ("d.wav", audio)})
    assert r.status == 404, r.text


# -- parity with `vllm serve` (item 5) ------------------------------------------------------

def max_model_len(model_dir) -> int:
    """What servectl's engine takes by default (the model's own), given to `vllm serve` as a flag."""
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text.get("max_position_embeddings") or cfg.get("max_target_positions") or 448)


@pytest.fixture(scope="module", params=["vision", "speech"])
def vllm_media(request, tmp_path_factory):
    model = VISION_DIR if request.param == "vision" else SPEECH_DIR
    flags = ("--allowed-media-domains", MEDIA_HOST) if request.param == "vision" else ()
    server = VllmServe(tmp_path_factory.mktemp(f"vllm-{request.param}"), model=model, served=request.param,
                       max_model_len=max_model_len(model), flags=flags)
    with vllm_serving(server, request.param) as base:
        yield request.param, base


def answer(r) -> tuple[int, object]:
    """(status, the answer without what differs by nature: ids and times): a stream's text, or a
    whole answer's choices and usage."""
    if r.status != 200:
        return r.status, None
    if r.text.startswith("data:"):
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        return 200, "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    body = json.loads(r.text)
    return 200, (body["choices"], body["usage"])


def vision_cases():
    png, _ = picture(9_500)
    url = data_url(png)
    yield "/v1/chat/completions", chat_body(url)
    yield "/v1/chat/completions", chat_body(url, stream=True)
    yield "/v1/chat/completions", chat_body("http://127.0.0.1:9/x.png")  # a host not allowed: both refuse
    yield "/v1/chat/completions", chat_body(data_url(png[: len(png) // 2]))  # a truncated PNG
    yield "/v1/messages", {"model": "vision", "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": QUESTION}]}]}


def test_media_answers_and_refusals_equal_vllm_serves(vllm_media, md):
    name, base = vllm_media
    (images_equal if name == "vision" else speech_equal)(md, base)


def images_equal(md, base: str) -> None:
    import anthropic
    import openai

    png, _ = picture(9_501)
    for path, body in vision_cases():
        ours, theirs = http(md, "POST", path, body), http(base, "POST", path, body, key=None)
        if path == "/v1/messages":
            a, b = json.loads(ours.text), json.loads(theirs.text)
            assert (ours.status, a["content"], a["usage"]) == (theirs.status, b["content"], b["usage"]), (a, b)
            continue
        assert answer(ours) == answer(theirs), (path, body.get("stream"), ours.text[:400], theirs.text[:400])
    # The SDKs' own calls: an image in /v1/responses, and in an Anthropic message.
    got = [openai.OpenAI(base_url=url, api_key="x").responses.create(
        model="vision", temperature=0, max_output_tokens=8, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(png)}, {"type": "input_text", "text": QUESTION}]}]
    ).output_text for url in (f"{md.base_url}/v1", f"{base}/v1")]
    assert got[0] == got[1], got
    got = [anthropic.Anthropic(base_url=url, api_key="x").messages.create(
        model="vision", max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": QUESTION}]}]).content[0].text for url in (md.base_url, base)]
    assert got[0] == got[1], got


def speech_equal(md, base: str) -> None:
    import openai

    clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
               for url in (md.base_url, base)]
    for digits, voice in zip(fresh_digits(6_200, 2), ("en", "de")):
        audio = spoken(digits, voice, seed=6_200)
        got = [c.audio.transcriptions.create(model="speech", file=("d.wav", audio), temperature=0).text
               for c in clients]
        assert got[0] == got[1], got
        got = [c.audio.translations.create(model="speech", file=("d.wav", audio), temperature=0).text
               for c in clients]
        assert got[0] == got[1], got
        got = [c.audio.transcriptions.create(model="speech", file=("d.wav", audio), language=voice,
                                             response_format="verbose_json", temperature=0).model_dump()
               for c in clients]
        assert [(g["text"], g["language"], g["duration"]) for g in got] == \
            [(got[1]["text"], got[1]["language"], got[1]["duration"])] * 2, got
    audio = spoken("11", "en")
    for fields, files in (({"model": "speech", "response_format": "srt"}, {"file": ("d.wav", audio)}),
                          ({"model": "speech"}, {"file": ("d.wav", b"RIFF....not audio")})):
        ours, theirs = form(md, "/v1/audio/transcriptions", fields, files), \
            form(base, "/v1/audio/transcriptions", fields, files)
        assert ours.status == theirs.status == 400, (ours.text, theirs.text)


# -- a crash mid-answer -----------------------------------------------------------------------

def test_a_worker_sigkill_mid_image_stream_and_mid_transcription_costs_no_errors(md):
    """A worker is SIGKILLed while its model's requests are in flight: image chats that have shown
    part of their answer (the first chunk stops the worker, then it is killed), transcriptions
    whole and streamed. Every answer arrives, equal to its unfaulted one (the new engine reads the
    media again; a speech request runs again from its audio)."""

    client = md.openai()
    png, truth = picture(9_400)
    body = chat_body(data_url(png), max_tokens=48, extra_body={"ignore_eos": True})
    image_ref = "".join(c.choices[0].delta.content or "" for c in
                        client.chat.completions.create(**body, stream=True) if c.choices)
    audio = spoken(fresh_digits(6_100, 1)[0], "en", seed=6_100)
    speech_ref = client.audio.transcriptions.create(model="speech", file=("d.wav", audio), temperature=0).text
    assert speech_ref.strip(), speech_ref

    def in_flight(model: str, jobs, stop_first: bool) -> list:
        pids = {c.component: c.pid for c in md.status().children}
        worker = pids[f"worker:{model}:0"]
        results, errors, shown = [], [], threading.Event()

        def run(job):
            try:
                results.append(job(shown, worker))
            except Exception as exc:  # noqa: BLE001 - the count is the assertion
                errors.append(repr(exc))

        if not stop_first:
            os.kill(worker, signal.SIGSTOP)  # nothing finishes until the kill
        threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        if stop_first:
            assert shown.wait(120), "no stream showed its first chunk"
        wait_for(lambda: requests_running(md, model) >= len(jobs) - (1 if stop_first else 0), 60, interval=0.05,
                 what=f"{model}'s requests in flight")
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: md.child(f"engine_core:{model}").pid != pids[f"engine_core:{model}"]
                 and next(m.state for m in md.status().models if m.name == model) == "ready", 300,
                 interval=0.1, what=f"{model}'s group restarted", diagnose=lambda: md.log_tails("manager"))
        for t in threads:
            t.join(600)
        assert errors == [], (model, errors)
        return sorted(results)

    def image_stream(shown, worker):
        text = ""
        for c in client.chat.completions.create(**body, stream=True):
            if c.choices and c.choices[0].delta.content:
                if not shown.is_set():
                    shown.set()
                    os.kill(worker, signal.SIGSTOP)  # mid-answer: the worker stops at once
                text += c.choices[0].delta.content
        return "image", text

    def transcription(shown, worker, stream=False):
        if stream:
            chunks = client.audio.transcriptions.create(model="speech", file=("d.wav", audio), temperature=0,
                                                        stream=True)
            return "speech", "".join((c.choices[0]["delta"].get("content") or "") for c in chunks
                                     if getattr(c, "choices", None))
        return "speech", client.audio.transcriptions.create(model="speech", file=("d.wav", audio),
                                                            temperature=0).text

    got = in_flight("vision", [image_stream, image_stream], stop_first=True)
    assert got == [("image", image_ref)] * 2, (got, image_ref)
    got = in_flight("speech", [transcription, transcription, lambda s, w: transcription(s, w, stream=True)],
                    stop_first=False)
    assert got == [("speech", speech_ref)] * 3, (got, speech_ref)
    assert_nothing_running(md)
