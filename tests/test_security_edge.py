"""Issue 53, items 3 and 6-9, on a real daemon: no route makes an engine fetch a URL a client
names (every content part, typed or not, is a 400 before anything reaches an engine, and the
engine's own connector fetches nothing unless the operator allowed domains)."""

from __future__ import annotations

import http.server as hs
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import http


class Recorder(hs.BaseHTTPRequestHandler):
    """Records every path asked; /redirect answers a redirect to /target."""
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        Recorder.hits.append(self.path)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/target")
            self.end_headers()
            return
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def recorder():
    server = hs.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def live_recorder(recorder):
    """The recorder, shown to hear a request (so zero hits below means none was made), then cleared."""
    Recorder.hits.clear()
    try:
        urllib.request.urlopen(recorder + "/probe", timeout=5)
    except urllib.error.HTTPError:
        pass
    assert Recorder.hits == ["/probe"]
    Recorder.hits.clear()
    return recorder


def cases(url: str):
    """(path, body) for every route that takes content, with a media part typed or not."""
    untyped = {"image_url": url}
    typed = {"type": "image_url", "image_url": {"url": url}}
    sneaky = {"type": "text", "text": "hi", "uuid": "u1", "image_url": url}  # vLLM reads it by its keys
    for part in (untyped, typed, sneaky):
        msgs = [{"role": "user", "content": [part]}]
        yield "/v1/chat/completions", {"model": "default", "messages": msgs, "max_tokens": 2}
        yield "/tokenize", {"model": "default", "messages": msgs}
        yield "/v1/responses", {"model": "default", "input": msgs, "max_output_tokens": 2}
        yield "/v1/messages", {"model": "default", "messages": msgs, "max_tokens": 2}
        yield "/v1/messages/count_tokens", {"model": "default", "messages": msgs}
        yield "/v1/embeddings", {"model": "default-embed", "messages": msgs}
        yield "/pooling", {"model": "default-embed", "messages": msgs}
        yield "/classify", {"model": "classify", "messages": msgs}
        yield "/v2/embed", {"model": "default-embed", "input_type": "search_document",
                            "embedding_types": ["float"], "inputs": [{"content": [part]}]}
        yield "/score", {"model": "classify", "queries": "q", "documents": {"content": [part]}}
        yield "/rerank", {"model": "classify", "query": "q", "documents": {"content": [part]}}
    yield "/v1/responses", {"model": "default", "max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}
    yield "/v1/messages", {"model": "default", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}}]}]}


def test_no_route_makes_an_engine_fetch_a_url(pooling_daemon, live_recorder):
    d = pooling_daemon
    answers = [(path, body, http(d, "POST", path, body)) for path, body in cases(live_recorder + "/x")]
    assert Recorder.hits == [], "an engine fetched a client's URL"
    # These models read no media: vLLM's own answer, a 400 for a media part it takes as one (a
    # part it reads as text, as Anthropic's converter does a text block's extra keys, is text).
    for path, body, r in answers:
        assert r.status in (200, 400), (path, body, r.status, r.text)
    refused = [(p, b) for p, b, r in answers if r.status == 400]
    assert len(refused) >= len(answers) - 3, [(p, r.status) for p, b, r in answers]
    assert all(r.status == 400 for p, b, r in answers if p == "/v1/chat/completions"), answers
    # The models still answer text.
    r = http(d, "POST", "/v1/chat/completions", {"model": "default", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.status == 200, r.text


ENGINE_CONNECTOR = """
import sys
from engine_core.media import close_media_fetching
close_media_fetching()
import vllm.envs as envs
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY
base, domains = sys.argv[1], sys.argv[2:]
conn = MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR, allowed_media_domains=domains or None)
try:
    conn.fetch_image(base + "/redirect")
except Exception as exc:
    print("refused:", type(exc).__name__, exc)
"""


def test_the_engines_connector_fetches_only_from_allowed_domains_without_redirects(live_recorder):
    """The second line: what an engine fetches if media ever got past the gateway."""
    def run(*domains):
        out = subprocess.run([sys.executable, "-c", ENGINE_CONNECTOR, live_recorder, *domains],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout
    out = run()  # no domains configured: nothing fetched
    assert "allowed_media_domains" in out and Recorder.hits == []
    out = run("127.0.0.1")  # the operator named the host: fetched, the redirect not followed
    assert "refused" in out and Recorder.hits == ["/redirect"], (out, Recorder.hits)


def test_the_gateway_knows_every_media_part_vllm_reads():
    """vLLM's own lists of what it takes for media (by key, by type): the gateway finds them all."""
    from vllm.renderers import chat_utils

    from api_gateway.media import MEDIA_KEYS, MEDIA_TYPES
    assert chat_utils._MEDIA_CONTENT_PART_KEYS <= MEDIA_KEYS
    assert set(chat_utils.MM_PARSER_MAP) - chat_utils._TEXT_CONTENT_PART_TYPES <= MEDIA_TYPES


def audit_file(d, name: str) -> list[dict]:
    import json
    state = d.runtime_dir / "state"
    return [json.loads(line) for path in (state / f"{name}.1", state / name) if path.exists()
            for line in path.read_text().splitlines()]


def test_a_flood_of_refusals_on_control_ro_leaves_the_accepted_lines(daemon):
    """Issue 53 item 7: 1,006 refused messages (35 KB audited each: 35 MB, past both 16 MiB
    generations) on the read-only socket; the accepted line stays, 20 refusals are written and
    the rest counted."""
    import zmq

    from servectl.client import ControlClient
    from servectl.config import ModelConfig
    from servectl.paths import RuntimePaths
    from servectl.wire import control as P

    reply = ControlClient(daemon.runtime_dir).request(P.SetFreezing(model="default", enabled=True))
    assert reply.ok, reply
    big = P.encoder.encode(P.LoadModel(model=ModelConfig(name="flood", model="/nowhere", engine_args={
        f"k{i}": "x" * 600 for i in range(64)})))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    start = time.monotonic()
    try:
        sock.connect(RuntimePaths.ipc(RuntimePaths(daemon.runtime_dir).control_ro))
        for _ in range(1006):
            sock.send(big)
        for _ in range(1006):  # every one refused (answered)
            assert sock.poll(60_000), "the manager stopped answering"
            assert not P.control_out_decoder.decode(sock.recv()).ok
    finally:
        sock.close()
    accepted = [r for r in audit_file(daemon, "audit.log") if r["command"] == "set_freezing"]
    assert accepted and accepted[-1]["outcome"] == "accepted"
    flood = [r for r in audit_file(daemon, "audit-denied.log") if r["via"] == "control-ro"]
    assert 1 <= len(flood) <= 21 + (time.monotonic() - start), len(flood)  # a burst, then one a second
    assert ControlClient(daemon.runtime_dir).request(P.SetFreezing(model="default", enabled=True)).ok
    said = [r.get("suppressed", 0) for r in audit_file(daemon, "audit-denied.log") if r["via"] == "control-ro"]
    assert sum(said) + len(said) >= 1006, said  # every refusal written or counted
