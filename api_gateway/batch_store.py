"""The Files and Batch APIs' store: files and batch records in the state directory.

Every record is written whole to a temporary name, flushed to the disk and renamed over the
old one, then the directory is flushed: a crash at any instant leaves the old record or the
new one, never a mix. A batch's results are appended line by line to its ``.output`` and
``.errors`` files (one ``write`` a line); what is in them is what is done, so a runner that
starts again (api_gateway/batch_runner.py) sends only the lines that are not, and each
``custom_id`` is answered once. Only the batch's runner writes its record; another gateway
that cancels it leaves a ``.cancel`` marker the runner reads before each line it sends.

Layout under ``<state>/batch``: ``files/<id>.json`` (the file's record) and ``files/<id>.data``;
``batches/<id>.json``, ``<id>.output``, ``<id>.errors``, ``<id>.cancel``. Records are msgspec
structs as JSON; the API's objects are made from them (``file_object``, ``batch_object``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

# A batch's states (OpenAI's names); the last four are ends.
VALIDATING, IN_PROGRESS, FINALIZING = "validating", "in_progress", "finalizing"
COMPLETED, FAILED, CANCELLING, CANCELLED, EXPIRED = "completed", "failed", "cancelling", "cancelled", "expired"
ENDED = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})
LEFTOVER_S = 3600.0


class FileRecord(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    owner: str  # the key label that made it (api_gateway/keys.py)
    expires_at: int | None = None


class BatchError(msgspec.Struct, kw_only=True, omit_defaults=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchRecord(msgspec.Struct, kw_only=True):
    id: str
    owner: str
    runner: int  # the gateway process that runs it (its index)
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = VALIDATING
    metadata: dict[str, str] | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    expired_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[BatchError] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    model: str | None = None
    gone_at: int | None = None  # when its record may be deleted (expire_after_s past its end)
    # While FINALIZING: the status it ends in (completed, cancelled, expired), decided before its
    # results are published, so that a runner starting again ends it the same way.
    ending: str | None = None


class Progress(msgspec.Struct, array_like=True):
    """A running batch's counts as its runner last wrote them (``<id>.progress``, rewritten after
    each line without a flush: after a power loss the record's, and the results files', stand)."""

    completed: int
    failed: int


_encoder = msgspec.json.Encoder()


def write_whole(path: Path, data: bytes, durable: bool = True) -> None:
    """``path`` holds ``data`` or what it held before, whatever happens meanwhile. ``durable``:
    on the disk when this returns (a state change); without, a process crash still leaves one or
    the other (a progress count, which the results files can always give again)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}" if prefix == "file" else f"{prefix}_{secrets.token_hex(12)}"


def result_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: the same each time it is made (a finalization
    that a crash cut short is done again to the same end)."""
    return "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]


class Store:
    """One gateway's view of the store (every gateway of the daemon opens the same directory)."""

    def __init__(self, state_dir: Path):
        self.root = state_dir / "batch"
        self.files = self.root / "files"
        self.batches = self.root / "batches"
        for d in (self.root, self.files, self.batches):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

    # ---- files -------------------------------------------------------------------------------
    def file_data(self, file_id: str) -> Path:
        return self.files / f"{file_id}.data"

    def upload_path(self) -> Path:
        """Where an upload is written before it is a file (``add_file`` renames it)."""
        return self.files / f".upload-{os.getpid()}-{secrets.token_hex(6)}"

    def add_file(self, data_from: Path, record: FileRecord, keep: bool = False) -> None:
        """The data first, then the record: a file is listed only once its data is whole.
        ``keep``: ``data_from`` stays (linked, not moved: a batch's results until it has ended)."""
        fd = os.open(data_from, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if keep:
            self.file_data(record.id).unlink(missing_ok=True)  # an earlier try's link, the same data
            os.link(data_from, self.file_data(record.id))
        else:
            os.replace(data_from, self.file_data(record.id))
        write_whole(self.files / f"{record.id}.json", _encoder.encode(record))

    def get_file(self, file_id: str) -> FileRecord | None:
        if not _plain(file_id):
            return None
        try:
            return msgspec.json.decode((self.files / f"{file_id}.json").read_bytes(), type=FileRecord)
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def list_files(self) -> Iterator[FileRecord]:
        for path in self.files.glob("*.json"):
            record = self.get_file(path.stem)
            if record is not None:
                yield record

    def delete_file(self, file_id: str) -> bool:
        """The record first (the file is gone for the API), then its data."""
        try:
            (self.files / f"{file_id}.json").unlink()
        except FileNotFoundError:
            return False
        self.file_data(file_id).unlink(missing_ok=True)
        return True

    def stored_bytes(self) -> int:
        total = 0
        for path in self.files.iterdir():
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total

    # ---- batches -----------------------------------------------------------------------------
    def batch_path(self, batch_id: str, suffix: str) -> Path:
        return self.batches / f"{batch_id}.{suffix}"

    def put_batch(self, record: BatchRecord, durable: bool = True) -> None:
        write_whole(self.batch_path(record.id, "json"), _encoder.encode(record), durable)

    def get_batch(self, batch_id: str, as_written: bool = False) -> BatchRecord | None:
        """The record; ``as_written`` False: as the API shows it (cancelling once a cancel was asked)."""
        if not _plain(batch_id):
            return None
        try:
            record = msgspec.json.decode(self.batch_path(batch_id, "json").read_bytes(), type=BatchRecord)
        except (FileNotFoundError, msgspec.DecodeError):
            return None
        if as_written:
            return record
        if record.status == IN_PROGRESS:
            try:
                progress = msgspec.json.decode(self.batch_path(batch_id, "progress").read_bytes(), type=Progress)
                record.completed, record.failed = progress.completed, progress.failed
            except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
                pass
        if record.status in (VALIDATING, IN_PROGRESS) and self.cancel_asked(batch_id):
            record.status = CANCELLING  # the runner has not seen it yet, or is finishing what runs
            record.cancelling_at = record.cancelling_at or self.cancel_time(batch_id)
        return record

    def put_progress(self, record: BatchRecord) -> None:
        write_whole(self.batch_path(record.id, "progress"), _encoder.encode(Progress(record.completed, record.failed)),
                    durable=False)

    def list_batches(self) -> Iterator[BatchRecord]:
        for path in self.batches.glob("*.json"):
            record = self.get_batch(path.stem)
            if record is not None:
                yield record

    def lock(self, batch_id: str, wait: bool = False) -> int | None:
        """The batch's lock (an open descriptor; closing it lets go), held by the runner running
        it, so that two gateways never run one batch (a reload that starts a gateway before its
        predecessor has drained, gateway 0 taking a removed gateway's). None: another holds it.
        ``wait``: block until it is free (on a thread of its own: ``wait_lock``)."""
        fd = os.open(self.batch_path(batch_id, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def wait_lock(self, batch_id: str, then: Callable[[int], None]) -> None:
        """``then(fd)`` once the lock is this process's (a daemon thread blocked in the kernel's
        flock: nothing polls; the process may exit while it waits)."""
        threading.Thread(target=lambda: then(self.lock(batch_id, wait=True)), daemon=True,
                         name=f"lock {batch_id}").start()

    def ask_cancel(self, batch_id: str) -> None:
        write_whole(self.batch_path(batch_id, "cancel"), str(int(time.time())).encode())

    def cancel_asked(self, batch_id: str) -> bool:
        return self.batch_path(batch_id, "cancel").exists()

    def cancel_time(self, batch_id: str) -> int:
        try:
            return int(self.batch_path(batch_id, "cancel").read_bytes() or 0)
        except (FileNotFoundError, ValueError):
            return int(time.time())

    def delete_batch(self, batch_id: str) -> None:
        self.batch_path(batch_id, "json").unlink(missing_ok=True)
        for suffix in ("output", "errors", "cancel", "progress", "lock"):
            self.batch_path(batch_id, suffix).unlink(missing_ok=True)

    # ---- expiry ------------------------------------------------------------------------------
    def sweep(self, now: float) -> int:
        """Delete the files past their ``expires_at`` and the ended batches past ``gone_at``: how
        many. Run when the store is used (a gateway's start, each upload and listing), not on a
        timer: what expired and was not asked for meanwhile is only on the disk a while longer."""
        gone = 0
        batches = list(self.list_batches())
        inputs = {b.input_file_id for b in batches if b.status not in ENDED}  # read again on a resume
        for record in list(self.list_files()):
            if record.expires_at is not None and record.expires_at <= now and record.id not in inputs:
                gone += self.delete_file(record.id)
        for batch in batches:
            if batch.gone_at is not None and batch.gone_at <= now:
                self.delete_batch(batch.id)
                gone += 1
        # What a crash left: an upload or a record not renamed into place, data whose record was
        # never written (an hour on: no writer takes that long between the two).
        for path in self.files.iterdir():
            try:
                stale = path.stat().st_mtime < now - LEFTOVER_S
            except FileNotFoundError:
                continue
            orphan = path.suffix == ".data" and not (self.files / f"{path.stem}.json").exists()
            if stale and (path.name.startswith(".") or orphan):
                path.unlink(missing_ok=True)
        return gone


def _plain(name: str) -> bool:
    """An id the store made (letters, digits, - and _): never a path."""
    return 0 < len(name) <= 64 and all(c.isalnum() or c in "-_" for c in name) and name.isascii()


def file_object(record: FileRecord) -> dict[str, Any]:
    """OpenAI's File object."""
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": record.created_at,
            "filename": record.filename, "purpose": record.purpose, "expires_at": record.expires_at,
            "status": "processed", "status_details": None}


def batch_object(record: BatchRecord) -> dict[str, Any]:
    """OpenAI's Batch object."""
    out: dict[str, Any] = {
        "id": record.id, "object": "batch", "endpoint": record.endpoint, "model": record.model,
        "errors": None, "input_file_id": record.input_file_id, "completion_window": record.completion_window,
        "status": record.status, "output_file_id": record.output_file_id, "error_file_id": record.error_file_id,
        "created_at": record.created_at, "in_progress_at": record.in_progress_at, "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at, "completed_at": record.completed_at, "failed_at": record.failed_at,
        "expired_at": record.expired_at, "cancelling_at": record.cancelling_at, "cancelled_at": record.cancelled_at,
        "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
        "metadata": record.metadata}
    if record.errors:
        out["errors"] = {"object": "list", "data": [msgspec.to_builtins(e) for e in record.errors]}
    return out
