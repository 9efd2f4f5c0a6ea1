"""OpenAI's Batch API (``/v1/batches``): create, retrieve, list, cancel.

A batch is run by the gateway process that took its ``create`` (api_gateway/batch_runner.py)
and read by any (the store is on the disk); it belongs to the key that made it, as files do
(files_api.py). Bounded by ``[gateway.batch]``: lines per batch (400) and batches not ended per
key (429).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from aiohttp import web

from api_gateway import batch_store as S
from api_gateway.batch_runner import BatchRunner
from api_gateway.bodies import read_bounded
from api_gateway.errors import HttpError
from api_gateway.files_api import list_response, owner_of, page, visible
from servectl.config import GatewayConfig

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOW_S = {"24h": 24 * 3600}  # OpenAI's one completion window


def count_lines(path: Path) -> int:
    """The non-blank lines of an input file (what a batch's ``total`` will be)."""
    return sum(1 for line in path.read_bytes().split(b"\n") if line.strip())


class CreateBatch(msgspec.Struct):  # (fields it does not know are ignored, as the routes' are)
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict | None = None  # OpenAI's; the files expire as [gateway.batch] says


class BatchesApi:
    def __init__(self, store: S.Store, runner: BatchRunner, cfg: Callable[[], GatewayConfig]):
        self.store = store
        self.runner = runner
        self.cfg = cfg

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{batch_id}", self.retrieve)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel)

    def owned(self, request: web.Request) -> S.BatchRecord:
        batch_id = request.match_info["batch_id"]
        record = self.store.get_batch(batch_id)
        if record is None or not visible(owner_of(request), record.owner):
            raise HttpError(404, f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found")
        return record

    async def create(self, request: web.Request) -> web.Response:
        cfg = self.cfg()
        raw = await read_bounded(request, request.read(), cfg)
        try:
            body = msgspec.json.decode(raw, type=CreateBatch)
        except msgspec.ValidationError as exc:
            raise HttpError(400, f"invalid batch: {exc}") from None
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"invalid JSON: {exc}") from None
        if body.endpoint not in ENDPOINTS:
            raise HttpError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, not {body.endpoint!r}",
                            param="endpoint", code="invalid_value")
        if body.completion_window not in WINDOW_S:
            raise HttpError(400, f"completion_window must be one of {', '.join(WINDOW_S)}", param="completion_window",
                            code="invalid_value")
        if body.metadata is not None and (len(body.metadata) > 16 or any(
                len(k) > 64 or len(v) > 512 for k, v in body.metadata.items())):
            raise HttpError(400, "metadata holds at most 16 pairs, keys of at most 64 characters and values of "
                                 "at most 512", param="metadata")
        key = owner_of(request)
        file = self.store.get_file(body.input_file_id)
        if file is None or not visible(key, file.owner) or file.purpose != "batch":
            raise HttpError(404 if file is None or not visible(key, file.owner) else 400,
                            f"no file with id {body.input_file_id!r} and purpose 'batch'", param="input_file_id")
        batch = cfg.batch
        lines = await asyncio.to_thread(count_lines, self.store.file_data(file.id))  # off the event loop
        if lines > batch.max_lines:
            raise HttpError(400, f"the input file has {lines} lines; a batch takes at most {batch.max_lines} "
                                 "([gateway.batch] max_lines)", param="input_file_id", code="too_many_lines")
        running = sum(1 for r in self.store.list_batches() if r.owner == key.label and r.status not in S.ENDED)
        if running >= batch.max_in_progress_per_key:
            raise HttpError(429, f"key {key.label!r} has {running} batches not ended, the most it may have "
                                 "([gateway.batch] max_in_progress_per_key): wait for one to end",
                            "requests", code="batch_limit_exceeded")
        now = int(time.time())
        record = S.BatchRecord(id=S.new_id("batch"), owner=key.label, runner=self.runner.index,
                               endpoint=body.endpoint, input_file_id=file.id,
                               completion_window=body.completion_window, created_at=now,
                               expires_at=now + WINDOW_S[body.completion_window], metadata=body.metadata,
                               total=lines)
        self.store.put_batch(record)
        self.runner.run(record)
        return web.json_response(S.batch_object(record))

    async def list(self, request: web.Request) -> web.Response:
        self.store.sweep(time.time())
        key = owner_of(request)
        records = [r for r in self.store.list_batches() if visible(key, r.owner)]
        return list_response(*page(request, records, lambda r: r.id), S.batch_object)

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(S.batch_object(self.owned(request)))

    async def cancel(self, request: web.Request) -> web.Response:
        record = self.owned(request)
        if record.status in S.ENDED:
            raise HttpError(409, f"batch {record.id} has ended ({record.status}): nothing to cancel",
                            code="batch_ended")
        if record.status != S.CANCELLING:
            self.store.ask_cancel(record.id)
            self.runner.cancel(record.id)
            record = self.store.get_batch(record.id) or record
        return web.json_response(S.batch_object(record))
