"""Runs a gateway's batches: each line sent as the request it is, through this gateway's own
routes, at the lowest priority, and its answer appended to the batch's results.

A line goes to a private listener of this gateway's app (a Unix socket, 0600) with the
runner's secret and the batch's owner (``BatchAuth``): the middleware counts it under that key
(its usage, its ``models``), the key's rate and concurrency limits do not apply to it, and the
fair share gives it the lowest priority (``BATCH_PRIORITY``), so interactive requests take its
slots (engine_core/slot_preemption.py) and it fills what they leave. Everything that makes an
ordinary request survive — held while its model loads, resumed on another engine after a crash —
holds for a line.

Crash-safe by its results (api_gateway/batch_store.py): a line's answer is appended once it is
whole; a runner that starts again (its gateway restarted, or the daemon) sends the lines not in
the results yet, so each ``custom_id`` is answered once. One runner a batch: it holds the
batch's lock while it runs it. The end is decided and written (FINALIZING, with ``ending``)
before the results are published as files, and the results are removed only once the batch has
ended: a runner starting at any point between ends it the same way. A line whose request failed
for the server's sake (429, 502-504, the connection) is sent again after a pause, unless the
batch is cancelled or expires meanwhile; any other answer is its answer (an error goes to the
error file). ``[gateway.batch] concurrency`` bounds the lines in flight of every batch this
gateway runs together.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec

from api_gateway import batch_lines as L
from api_gateway import batch_store as S
from api_gateway.keys import RequestKey
from servectl.config import BatchConfig
from servectl.wire.engine import BATCH_PRIORITY

log = logging.getLogger("api_gateway.batch")

SECRET_HEADER = "X-Servectl-Batch"
OWNER_HEADER = "X-Servectl-Batch-Owner"
RETRY = frozenset({429, 502, 503, 504})
MAX_PAUSE_S = 30.0


class BatchAuth:
    """What the middleware asks of a request with the runner's header: the key it runs under."""

    def __init__(self, resolve: Callable[[str], RequestKey | None]):
        self.secret = secrets.token_urlsafe(32)
        self.resolve = resolve  # a key label to the key configured now (None: no such key now)

    def key_of(self, secret: str, owner: str) -> RequestKey | None:
        """None: not the runner's secret, or the batch's key is no longer configured."""
        if not hmac.compare_digest(secret.encode(), self.secret.encode()):
            return None
        return self.resolve(owner)


class BatchRunner:
    """This gateway's batches: the ones it took, and those of a gateway index no longer run."""

    def __init__(self, store: S.Store, index: int, processes: int, cfg: Callable[[], BatchConfig],
                 auth: BatchAuth, socket_name: str):
        self.store = store
        self.index = index
        self.processes = processes
        self.cfg = cfg
        self.auth = auth
        self.socket_name = socket_name
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancels: dict[str, asyncio.Event] = {}
        self.locks: dict[str, int] = {}
        self.waiting: set[str] = set()  # batches whose lock another process holds: taken when it lets go
        self.slots: asyncio.Semaphore | None = None  # the lines in flight, every batch together
        self.session: aiohttp.ClientSession | None = None
        self.stopping = False

    def mine(self, record: S.BatchRecord) -> bool:
        return record.runner == self.index or (self.index == 0 and record.runner >= self.processes)

    def resume(self) -> int:
        """At the gateway's start: every batch of this runner not ended yet goes on."""
        self.store.sweep(time.time())
        count = 0
        for record in self.store.list_batches():
            if record.status not in S.ENDED and self.mine(record):
                self.run(record)
                count += 1
        if count:
            log.info("resuming %d batch(es)", count)
        return count

    def run(self, record: S.BatchRecord) -> None:
        if record.id in self.tasks or record.id in self.waiting or self.stopping:
            return
        fd = self.store.lock(record.id)
        if fd is not None:
            return self._start(record.id, fd)
        # Another gateway runs it still (its predecessor draining, or the one it was given to).
        log.info("batch %s is run by another gateway: taken over when that one lets it go", record.id)
        self.waiting.add(record.id)
        loop = asyncio.get_running_loop()
        self.store.wait_lock(record.id, lambda fd: loop.call_soon_threadsafe(self._locked, record.id, fd))

    def _locked(self, batch_id: str, fd: int) -> None:
        self.waiting.discard(batch_id)
        if self.stopping:
            os.close(fd)
            return
        self._start(batch_id, fd)

    def _start(self, batch_id: str, fd: int) -> None:
        self.locks[batch_id] = fd
        self.cancels[batch_id] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._run(batch_id), name=f"batch {batch_id}")
        self.tasks[batch_id] = task
        task.add_done_callback(lambda t, bid=batch_id: self._ended(bid, t))

    def _ended(self, batch_id: str, task: asyncio.Task) -> None:
        self.tasks.pop(batch_id, None)
        self.cancels.pop(batch_id, None)
        os.close(self.locks.pop(batch_id))  # another gateway may run it now
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("batch %s stopped: %s: %s (it goes on when this gateway starts again)", batch_id,
                      type(exc).__name__, exc, exc_info=exc)

    def cancel(self, batch_id: str) -> None:
        """The cancel was asked here (the marker is written): a runner in this process stops at once."""
        event = self.cancels.get(batch_id)
        if event is not None:
            event.set()

    async def stop(self) -> None:
        """The gateway drains: no line is sent any more; those in flight are left unanswered (the
        runner that starts next sends them again)."""
        self.stopping = True
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def client(self) -> aiohttp.ClientSession:
        if self.session is None:
            connector = aiohttp.UnixConnector(path=self.socket_name, limit=0)
            self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        return self.session

    # ---- one batch -------------------------------------------------------------------------------
    async def _run(self, batch_id: str) -> None:
        record = self.store.get_batch(batch_id, as_written=True)
        if record is None or record.status in S.ENDED:
            return
        if record.status != S.FINALIZING:
            checked = await asyncio.to_thread(self._read, record)  # up to max_file_bytes: off the event loop
            if checked is None:
                return self._fail(record, "input_file_missing", f"the input file {record.input_file_id} is gone")
            if record.status == S.VALIDATING:
                if checked.fatal or not (checked.lines or checked.bad):
                    errors = checked.fatal or [S.BatchError(code="empty_file", message="the input file has no lines")]
                    return self._fail(record, errors=errors)
                # The lines that cannot be sent are answered first, whole (a crash here validates again).
                S.write_whole(self.store.batch_path(batch_id, "errors"), b"".join(checked.bad))
                record.status, record.in_progress_at = S.IN_PROGRESS, int(time.time())
                record.total, record.model = len(checked.lines) + len(checked.bad), checked.model
                self.store.put_batch(record)
            await self._send_lines(record, checked.lines)
        self._finish(record)

    def _read(self, record: S.BatchRecord) -> L.Checked | None:
        if self.store.get_file(record.input_file_id) is None:
            return None
        try:
            return L.check(self.store.file_data(record.input_file_id).read_bytes(), record.endpoint)
        except FileNotFoundError:
            return None

    async def _send_lines(self, record: S.BatchRecord, lines: list[L.Line]) -> None:
        """Every line not answered yet, until they all are or the batch is cancelled or expires;
        then its end, decided and written (FINALIZING with ``ending``)."""
        out_path, err_path = self.store.batch_path(record.id, "output"), self.store.batch_path(record.id, "errors")
        done: set[str] = set()
        record.completed = record.failed = 0
        for path in (out_path, err_path):
            data = path.read_bytes() if path.exists() else b""
            ids, ok, failed, end = L.answered(data)
            if end != len(data):  # a line cut by a crash mid-write: it is sent again
                os.truncate(path, end)
            done |= ids
            record.completed += ok
            record.failed += failed
        self.store.put_progress(record)
        cancel = self.cancels[record.id]
        loop = asyncio.get_running_loop()
        # event-proof: one deadline a running batch (its completion window), cancelled when it ends.
        expiry = loop.call_at(loop.time() + max(0.0, record.expires_at - time.time()), cancel.set)
        if time.time() >= record.expires_at:
            cancel.set()  # expired while no runner ran it: nothing more is sent
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.cfg().concurrency)
        slots = self.slots
        out = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        err = os.open(err_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        in_flight: set[asyncio.Task] = set()
        try:
            for line in lines:
                if line.custom_id in done:
                    continue
                if cancel.is_set() or self.store.cancel_asked(record.id):
                    break
                await slots.acquire()
                if cancel.is_set() or self.store.cancel_asked(record.id):
                    slots.release()
                    break
                task = loop.create_task(self._line(record, line, out, err, cancel))
                in_flight.add(task)
                task.add_done_callback(lambda t: (in_flight.discard(t), slots.release()))
            if in_flight:
                await asyncio.gather(*in_flight)
        finally:
            expiry.cancel()
            for task in in_flight:
                task.cancel()
            os.fsync(out)
            os.fsync(err)
            os.close(out)
            os.close(err)
        now = int(time.time())
        if self.store.cancel_asked(record.id) or (cancel.is_set() and now < record.expires_at):
            record.ending, record.cancelled_at = S.CANCELLED, now
            record.cancelling_at = record.cancelling_at or self.store.cancel_time(record.id)
        elif cancel.is_set():
            record.ending, record.expired_at = S.EXPIRED, now
            self._expire_rest(record, lines, err_path)
        else:
            record.ending = S.COMPLETED
        record.status, record.finalizing_at = S.FINALIZING, now
        self.store.put_batch(record)

    def _expire_rest(self, record: S.BatchRecord, lines: list[L.Line], err_path: Path) -> None:
        """The lines never answered are, in the error file, as OpenAI's expired ones are."""
        done = L.answered(err_path.read_bytes())[0] | \
            L.answered(self.store.batch_path(record.id, "output").read_bytes())[0]
        rest = [L.error_line(line.custom_id, "batch_expired", "the batch expired before this request ran")
                for line in lines if line.custom_id not in done]
        fd = os.open(err_path, os.O_WRONLY | os.O_APPEND)
        try:
            append(fd, b"".join(rest))
            os.fsync(fd)
        finally:
            os.close(fd)
        record.failed += len(rest)

    async def _line(self, record: S.BatchRecord, line: L.Line, out: int, err: int, cancel: asyncio.Event) -> None:
        headers = {SECRET_HEADER: self.auth.secret, OWNER_HEADER: record.owner, "Host": "localhost"}
        pause = 1.0
        while True:
            try:
                async with self.client().post(f"http://localhost{record.endpoint}", json=line.body,
                                              headers=headers) as resp:
                    raw = await resp.read()
                    status, request_id = resp.status, resp.headers.get("X-Request-Id", "")
                    retry_after = resp.headers.get("Retry-After")
            except (aiohttp.ClientError, OSError) as exc:
                if self.stopping:
                    raise asyncio.CancelledError from exc
                log.warning("batch %s, line %d: no answer (%s: %s); sent again in %gs", record.id, line.number,
                            type(exc).__name__, exc, pause)
                status, raw, request_id, retry_after = 0, b"", "", None
            if status and status not in RETRY:
                break
            wait = pause if retry_after is None or not retry_after.isdigit() else float(retry_after)
            # A pause only while this line's request could not be served (the model's queue full, its
            # engine failed, the gateway restarting): sent again after, unless the batch is cancelled
            # or expires meanwhile (the line is then left unanswered, or answered as expired).
            try:
                # event-proof: the pause above, ended early by the batch's cancel or expiry.
                await asyncio.wait_for(cancel.wait(), min(wait, MAX_PAUSE_S))
                return
            except asyncio.TimeoutError:
                pass
            if self.store.cancel_asked(record.id):
                return
            pause = min(pause * 2, MAX_PAUSE_S)
        try:
            body = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            body = raw.decode("utf-8", "replace")
        answer = L.output_line(line.custom_id, status, request_id, body)
        if 200 <= status < 300:
            append(out, answer)
            record.completed += 1
        else:
            append(err, answer)
            record.failed += 1
        self.store.put_progress(record)  # for retrieve; the results files can always give it again

    # ---- the end ---------------------------------------------------------------------------------
    def _finish(self, record: S.BatchRecord) -> None:
        """FINALIZING → its ``ending``: the results published as files (linked: the batch's own
        stay until the record says it ended), the ended record, then the batch's results removed."""
        self._results_files(record)
        record.status = record.ending or S.COMPLETED
        if record.status == S.COMPLETED:
            record.completed_at = int(time.time())
        self._ended_record(record)

    def _results_files(self, record: S.BatchRecord) -> None:
        """The output and error files become files of the Files API (ids fixed by the batch's: a
        finalization a crash cut short is done again to the same end)."""
        expire = self.cfg().expire_after_s
        for kind, suffix in (("output", "output"), ("error", "errors")):
            path = self.store.batch_path(record.id, suffix)
            file_id = S.result_file_id(record.id, kind)
            if path.exists() and path.stat().st_size:
                now = int(time.time())
                self.store.add_file(path, S.FileRecord(
                    id=file_id, bytes=path.stat().st_size, created_at=now, filename=f"{record.id}_{kind}.jsonl",
                    purpose="batch_output", owner=record.owner, expires_at=now + int(expire) if expire else None),
                    keep=True)
            if self.store.get_file(file_id) is not None:
                setattr(record, f"{kind}_file_id", file_id)

    def _fail(self, record: S.BatchRecord, code: str = "", message: str = "",
              errors: list[S.BatchError] | None = None) -> None:
        record.status, record.failed_at = S.FAILED, int(time.time())
        record.errors = errors or [S.BatchError(code=code, message=message)]
        self._results_files(record)  # what was answered before it failed is kept
        self._ended_record(record)

    def _ended_record(self, record: S.BatchRecord) -> None:
        expire = self.cfg().expire_after_s
        record.gone_at = int(time.time() + expire) if expire else None
        self.store.put_batch(record)
        # The batch's own results go once the record says it ended (published as files before it).
        for suffix in ("output", "errors", "progress", "cancel"):
            self.store.batch_path(record.id, suffix).unlink(missing_ok=True)
        log.info("batch %s %s: %d of %d answered, %d failed", record.id, record.status, record.completed,
                 record.total, record.failed)


def append(fd: int, data: bytes) -> None:
    """``data`` at the end of the file, whole or not at all (a short write, a full disk: cut back)."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        os.ftruncate(fd, start)
        raise
