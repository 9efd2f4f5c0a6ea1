"""OpenAI's Files API (``/v1/files``), for batches: upload, list, retrieve, content, delete.

A file belongs to the key that uploaded it: another key gets a 404, an admin key sees every
one (without API keys, everyone is the same owner). Stored by api_gateway/batch_store.py,
bounded by ``[gateway.batch]``: one file's size (413), every stored file's together (413), and
kept ``expire_after_s`` unless the upload says otherwise (``expires_after``, as OpenAI's).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from api_gateway import batch_store as S
from api_gateway.errors import HttpError
from api_gateway.keys import Access, RequestKey
from servectl.config import GatewayConfig

PURPOSES = frozenset({"batch"})
CHUNK = 1 << 20


def owner_of(request: web.Request) -> RequestKey:
    return request["key"]


def visible(key: RequestKey, owner: str) -> bool:
    return key.access is Access.ADMIN or key.label == owner


def page(request: web.Request, items: Iterable[Any], id_of: Callable[[Any], str],
         newest_first: bool = True) -> tuple[list[Any], bool]:
    """OpenAI's list paging: ``limit`` (1-10000, 20 by default), ``after`` (an id), ``order``."""
    raw = request.query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 10_000:
        raise HttpError(400, f"limit must be an integer from 1 to 10000, not {raw!r}", param="limit")
    order = request.query.get("order", "desc" if newest_first else "asc")
    if order not in ("asc", "desc"):
        raise HttpError(400, f"order must be 'asc' or 'desc', not {order!r}", param="order")
    ordered = sorted(items, key=lambda r: (r.created_at, id_of(r)), reverse=order == "desc")
    after = request.query.get("after")
    if after is not None:
        ids = [id_of(r) for r in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    limit = int(raw)
    return ordered[:limit], len(ordered) > limit


def list_response(shown: list[Any], more: bool, to_object: Callable[[Any], dict]) -> web.Response:
    """OpenAI's list object of a page (``page``)."""
    data = [to_object(r) for r in shown]
    return web.json_response({"object": "list", "data": data, "has_more": more,
                              "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


class FilesApi:
    def __init__(self, store: S.Store, cfg: Callable[[], GatewayConfig]):
        self.store = store
        self.cfg = cfg

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.create)
        app.router.add_get("/v1/files", self.list)
        app.router.add_get("/v1/files/{file_id}", self.retrieve)
        app.router.add_get("/v1/files/{file_id}/content", self.content)
        app.router.add_delete("/v1/files/{file_id}", self.delete)

    def owned(self, request: web.Request) -> S.FileRecord:
        """The file the path names, if this request's key may see it (else 404, as for none)."""
        file_id = request.match_info["file_id"]
        record = self.store.get_file(file_id)
        if record is None or not visible(owner_of(request), record.owner) or \
                (record.expires_at is not None and record.expires_at <= time.time()):
            raise HttpError(404, f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return record

    async def create(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/form-data"):
            raise HttpError(415, "upload a file as multipart/form-data (fields `file` and `purpose`)")
        batch = self.cfg().batch
        fields: dict[str, str] = {}
        upload = self.store.upload_path()
        size, filename = -1, None
        try:
            reader = await request.multipart()
            while (part := await self.timed(reader.next())) is not None:
                if part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    size = await self.save(part, upload, batch.max_file_bytes)
                elif part.name:
                    fields[part.name] = (await self.timed(part.read(decode=True)))[:1024].decode("utf-8", "replace")
            if size < 0:
                raise HttpError(400, "no `file` part in the upload", param="file")
            purpose = fields.get("purpose")
            if purpose not in PURPOSES:
                raise HttpError(400, f"purpose must be one of {sorted(PURPOSES)}, not {purpose!r}", param="purpose")
            now = int(time.time())
            self.store.sweep(now)
            if self.store.stored_bytes() > batch.max_stored_bytes:
                raise HttpError(413, f"the stored files would pass [gateway.batch] max_stored_bytes "
                                     f"({batch.max_stored_bytes} bytes): delete some first",
                                code="storage_limit_exceeded")
            record = S.FileRecord(id=S.new_id("file"), bytes=size, created_at=now, filename=filename[:256],
                                  purpose=purpose, owner=owner_of(request).label,
                                  expires_at=self.expiry(fields, now, batch.expire_after_s))
            await asyncio.to_thread(self.store.add_file, upload, record)  # its fsync: off the event loop
        finally:
            upload.unlink(missing_ok=True)
        return web.json_response(S.file_object(record))

    async def timed(self, awaitable):
        try:
            # event-proof: a client sending its upload; past the deadline it is a 408.
            return await asyncio.wait_for(awaitable, self.cfg().body_timeout_s)
        except asyncio.TimeoutError:
            raise HttpError(408, "the upload stalled past gateway.body_timeout_s") from None

    async def save(self, part, path, limit: int) -> int:
        size = 0
        with open(path, "wb", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            while chunk := await self.timed(part.read_chunk(CHUNK)):
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, f"the file is larger than [gateway.batch] max_file_bytes ({limit} bytes)",
                                    param="file", code="file_too_large")
                f.write(chunk)
        return size

    @staticmethod
    def expiry(fields: dict[str, str], now: int, default_s: float) -> int | None:
        """OpenAI's ``expires_after[anchor]=created_at`` and ``expires_after[seconds]`` (3600 to 30
        days); else the configured time (0: never)."""
        seconds = fields.get("expires_after[seconds]")
        if seconds is None:
            return now + int(default_s) if default_s else None
        if fields.get("expires_after[anchor]", "created_at") != "created_at":
            raise HttpError(400, "expires_after[anchor] must be 'created_at'", param="expires_after[anchor]")
        if not seconds.isdigit() or not 3600 <= int(seconds) <= 30 * 86400:
            raise HttpError(400, "expires_after[seconds] must be from 3600 to 2592000", param="expires_after[seconds]")
        return now + int(seconds)

    async def list(self, request: web.Request) -> web.Response:
        self.store.sweep(time.time())
        key, purpose = owner_of(request), request.query.get("purpose")
        records = [r for r in self.store.list_files()
                   if visible(key, r.owner) and (purpose is None or r.purpose == purpose)]
        return list_response(*page(request, records, lambda r: r.id), S.file_object)

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(S.file_object(self.owned(request)))

    async def content(self, request: web.Request) -> web.StreamResponse:
        record = self.owned(request)
        return web.FileResponse(self.store.file_data(record.id), headers={
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'attachment; filename="{record.id}.jsonl"'})

    async def delete(self, request: web.Request) -> web.Response:
        record = self.owned(request)
        using = next((b.id for b in self.store.list_batches()
                      if b.input_file_id == record.id and b.status not in S.ENDED), None)
        if using is not None:  # its runner reads it again when it resumes
            raise HttpError(409, f"file {record.id} is the input of batch {using}, not ended: cancel it first",
                            code="file_in_use")
        self.store.delete_file(record.id)
        return web.json_response({"id": record.id, "object": "file", "deleted": True})
