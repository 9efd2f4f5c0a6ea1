"""The engine fetches no media URL the operator did not allow (the second line behind the gateway's
api_gateway/media.py).

vLLM's ``MediaConnector`` fetches any http(s) URL a request names when the
model's ``allowed_media_domains`` is empty (its default: empty means any
host), follows redirects (``VLLM_MEDIA_URL_ALLOW_REDIRECTS``, on by default)
and retries, on the engine's thread; its errors tell an open port from a
closed one. ``close_media_fetching`` (called once, before the engine is built)
registers ``ClosedMediaConnector`` as vLLM's connector and turns redirects off,
each unless the model's ``env`` chose otherwise: an empty allowlist then means
no host, and fetching is opened only by naming hosts in the model's
``engine_args`` (``allowed_media_domains``). A fetched file is capped at
``FETCH_CAP_MB`` (``VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB``, vLLM's 256 otherwise).
Local files stay vLLM's rule: none without ``allowed_local_media_path``.
``data:`` URLs fetch nothing and are left to vLLM (the gateway bounded their
size: api_gateway/media.py). A fetch runs on the engine's thread, within
vLLM's fetch timeouts (``VLLM_IMAGE_FETCH_TIMEOUT`` 5 s, audio 10 s, video
30 s), which is why it is off until the operator names the hosts.
"""

from __future__ import annotations

import os

CONNECTOR = "servectl-closed"
FETCH_CAP_MB = 20


def close_media_fetching() -> None:
    """Make vLLM's connector this one and redirects off, unless the model's env set them."""
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    class ClosedMediaConnector(MediaConnector):
        """vLLM's connector, with an empty domain allowlist meaning no host rather than any."""

        # vLLM's one check before each http(s) fetch, sync and async (pinned: tools/vllm_pins.py).
        def _assert_url_in_allowed_media_domains(self, url_spec) -> None:
            if not self.allowed_media_domains:
                raise ValueError("fetching media URLs is off: the model's engine_args name no "
                                 "allowed_media_domains")
            super()._assert_url_in_allowed_media_domains(url_spec)

    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR)(ClosedMediaConnector)
    # vLLM reads its environment when asked (envs.__getattr__) until the engine core caches it.
    os.environ.setdefault("VLLM_MEDIA_CONNECTOR", CONNECTOR)
    os.environ.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    # A fetched file's bytes: vLLM's 256 MB cap lowered to the gateway's inline default (20 MiB).
    os.environ.setdefault("VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", str(FETCH_CAP_MB))
