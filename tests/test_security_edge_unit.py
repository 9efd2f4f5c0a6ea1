"""Issue 53, items 3 and 6-9, the pure parts: media refused in every body; the status page's
streams capped; control-ro refusals rate-limited in the audit log; LoRA adapter roots; the
page's cookie named and signed with its port, its actions and streams same-origin only.
No daemon; no vLLM or torch.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from api_gateway.errors import HttpError
from api_gateway.media import refuse_media
from api_gateway.ui_hub import STREAMS_MAX, STREAMS_PER_ADDRESS, stream_cap
from gateway_harness import run

pytestmark = pytest.mark.unit

URL = "http://127.0.0.1:9/x"


# -- item 3: every content part of every route, typed or not --------------------------------

@pytest.mark.parametrize("body", [
    # untyped parts, which vLLM takes by their keys
    {"messages": [{"role": "user", "content": [{"image_url": URL}]}]},
    {"messages": [{"role": "user", "content": [{"audio_url": {"url": URL}}]}]},
    {"input": [{"role": "user", "content": [{"video_url": URL}]}]},
    # a text part with a uuid: vLLM then reads it by its keys
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "uuid": "u", "image_url": URL}]}]},
    # Cohere's /v2/embed and the score routes' content lists
    {"inputs": [{"content": [{"type": "image_url", "image_url": {"url": URL}}]}]},
    {"inputs": [{"content": [{"image_url": URL}]}]},
    {"queries": "q", "documents": {"content": [{"type": "image_url", "image_url": {"url": URL}}]}},
    {"query": "q", "documents": [{"content": [{"image_url": URL}]}]},
    {"data_1": "a", "data_2": {"content": [{"image_url": URL}]}},
    # the Responses API, Anthropic's Messages (a tool result's image), a system prompt
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": URL}]}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file",
                                                                             "file_url": URL}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": URL}}]}]}]},
    {"system": [{"type": "document", "source": {"type": "url", "url": URL}}]},
    {"instructions": [{"type": "message", "role": "system", "content": [{"image_url": URL}]}]},
])
def test_media_in_any_field_typed_or_not_is_a_400_naming_the_field(body):
    with pytest.raises(HttpError) as info:
        refuse_media({"model": "m", **body})
    assert info.value.status == 400 and "multimodal" in info.value.message
    assert info.value.param in body


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "image_url"}]}]},
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
    # a tool whose parameter is named image_url, a schema, a tool call's arguments: not content
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"image_url": {"type": "string"}}}}}]},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "properties": {"file": {"type": "string"}}}}}},
    {"text": {"format": {"type": "json_schema", "schema": {"properties": {"image_url": {}}}}}},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                     "input": {"image_url": "a string argument"}}]}]},
    {"inputs": [{"content": [{"type": "text", "text": "hello"}]}], "texts": ["a"]},
])
def test_text_and_non_content_fields_pass(body):
    refuse_media({"model": "m", **body})


# -- item 6: status page streams capped per gateway and per address, writes bounded ----------

async def open_stream(h, local: str = "127.0.0.1"):
    """A /ui/stream on a raw connection from ``local`` that reads nothing: (status line, writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", h.port, local_addr=(local, 0))
    writer.write(b"GET /ui/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return head.split(b"\r\n", 1)[0], writer


def quiet_sampler(h):
    async def sample_once():  # no manager in the harness
        return None
    h.gw.ui.hub.sample_once = sample_once


def test_streams_are_capped_per_gateway_and_the_api_keeps_its_connections():
    async def scenario(h):
        quiet_sampler(h)
        assert stream_cap(12) == 3 and stream_cap(3) == 1 and stream_cap(10_000) == STREAMS_MAX
        streams = [await open_stream(h, f"127.0.0.{i + 1}") for i in range(3)]
        assert all(b" 200 " in line for line, _ in streams)
        line, writer = await open_stream(h, "127.0.0.9")
        assert b" 503 " in line  # a fourth: refused, not held
        writer.close()
        async with aiohttp.ClientSession() as s:  # the API is served beside them
            for _ in range(3):
                async with s.get(h.url + "/version") as r:
                    assert r.status == 200
        for _, w in streams:
            w.close()
    run(scenario, max_connections=12)


def test_streams_are_capped_per_address():
    async def scenario(h):
        quiet_sampler(h)
        streams = [await open_stream(h) for _ in range(STREAMS_PER_ADDRESS)]
        assert all(b" 200 " in line for line, _ in streams)
        line, writer = await open_stream(h)
        assert b" 503 " in line
        writer.close()
        other, w2 = await open_stream(h, "127.0.0.2")  # another address still may
        assert b" 200 " in other
        for _, w in [*streams, (other, w2)]:
            w.close()
    run(scenario, max_connections=400)


def test_a_stream_that_reads_nothing_is_closed_when_a_write_stalls():
    async def scenario(h):
        quiet_sampler(h)
        h.gw.ui.write_timeout_s = 0.5
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", h.port))
        sock.sendall(b"GET /ui/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await asyncio.sleep(0.3)
        hub = h.gw.ui.hub
        assert len(hub.pages) == 1
        page = next(iter(hub.pages))
        page.push(b": " + b"x" * (64 << 20) + b"\n\n")  # far more than any buffer: the write stalls
        for _ in range(100):
            if not hub.pages:
                break
            await asyncio.sleep(0.1)
        assert not hub.pages  # the page was dropped, its slot free
        sock.close()
    run(scenario)
