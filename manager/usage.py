"""Usage per key and model, by the minute, kept in the state directory (``<state>/usage/``).

Every finished request a gateway reports (``Finished``) is added to its minute's bucket
and written at once as one line appended to the current log file (``<n>.log``): a write
the kernel has, so a killed manager (or gateway, or engine) loses no count of a finished
request; a host crash may lose the last lines the page cache held (no fsync per request).
At start the snapshot (``ledger.json``) and the logs it has not absorbed are read, a new
snapshot naming the logs it absorbed is written (a temporary file, fsync, rename, fsync of
the directory), and only then are those logs removed: a crash at any instant leaves the old
state or the new one, never a count twice. Minutes older than ``MINUTES_KEPT_S`` are merged
into hours there.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from pathlib import Path

from servectl.wire import control as P

log = logging.getLogger("manager.usage")

SNAPSHOT = "ledger.json"
MINUTES_KEPT_S = 2 * 86400  # older minutes become hours at the next start
ROLL_LINES = 100_000  # a log this long is folded into the snapshot while running (a start reads little)
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "errors")

Bucket = tuple[int, str, str]  # (start: unix seconds, key, model)


class UsageLedger:
    """The counts (``buckets``: a bucket's start is a minute's, or an hour's once merged) and their files."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.buckets: dict[Bucket, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self.totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self.fd = -1
        self.number = 0  # the current log's
        self.lines = 0  # written to it

    def open(self, now: float) -> None:
        """Read what is kept, write it back as one snapshot, and start a new log."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        absorbed: set[str] = set()
        snap = self.dir / SNAPSHOT
        if snap.exists():
            try:
                data = json.loads(snap.read_text())
                absorbed = set(data["absorbed"])
                buckets = [((int(start), str(key), str(model)), [int(n) for n in counts])
                           for start, key, model, *counts in data["buckets"]]
            except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
                # Kept aside, not overwritten: what it held can still be read by hand.
                aside = snap.with_suffix(f".unreadable-{int(now)}")
                log.error("usage snapshot %s unreadable (%s): moved to %s; counting from the logs", snap, exc, aside)
                os.replace(snap, aside)
                absorbed, buckets = set(), []
            for bucket, counts in buckets:
                self._add(bucket, counts)
        logs = sorted((p for p in self.dir.glob("*.log") if p.stem.isdigit()), key=lambda p: int(p.stem))
        for path in logs:
            if path.name in absorbed:
                continue
            with path.open("rb") as lines:
                self._replay(lines)
        self._merge_old(now)
        self._write_snapshot([p.name for p in logs])
        for path in logs:
            path.unlink(missing_ok=True)
        self._next_log(int(logs[-1].stem) + 1 if logs else 1)

    def _replay(self, lines) -> None:
        for line in lines:
            try:
                start, key, model, *counts = json.loads(line)
                self._add((int(start), str(key), str(model)), counts)
            except (ValueError, TypeError):
                continue  # a line cut by a crash mid-write

    def _next_log(self, number: int) -> None:
        self.number, self.lines = number, 0
        self.fd = os.open(self.dir / f"{number}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def _roll(self) -> None:
        """The current log folded into the snapshot (which has all the counts: they are in memory),
        then removed, and a new one begun; a crash between leaves it named as absorbed."""
        current = self.dir / f"{self.number}.log"
        os.close(self.fd)
        self.fd = -1
        self._write_snapshot([current.name])
        current.unlink(missing_ok=True)
        self._next_log(self.number + 1)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def add(self, key: str, model: str, prompt: int, completion: int, error: bool, now: float) -> None:
        """One finished request: counted, and its line written."""
        counts = [1, prompt, completion, int(error)]
        start = int(now // 60 * 60)
        self._add((start, key, model), counts)
        if self.fd >= 0:
            try:
                os.write(self.fd, json.dumps([start, key, model, *counts], separators=(",", ":")).encode() + b"\n")
                self.lines += 1
                if self.lines >= ROLL_LINES:
                    self._roll()
            except OSError as exc:
                log.error("usage not written (%s): kept in memory, written at the next fold", exc)

    def rows(self, since: float | None) -> list[P.UsageRow]:
        """Per key and model, summed over the buckets that start at or after ``since`` (its minute)."""
        if since is None:
            source = self.totals.items()
        else:
            edge = int(since // 60 * 60)
            sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
            for (start, key, model), counts in self.buckets.items():
                if start >= edge:
                    row = sums[key, model]
                    for i, n in enumerate(counts):
                        row[i] += n
            source = sums.items()
        return [P.UsageRow(key=key, model=model, **dict(zip(FIELDS, counts))) for (key, model), counts in sorted(source)]

    def _add(self, bucket: Bucket, counts: list[int]) -> None:
        row, total = self.buckets[bucket], self.totals[bucket[1], bucket[2]]
        for i, n in enumerate(counts[:4]):
            row[i] += int(n)
            total[i] += int(n)

    def _merge_old(self, now: float) -> None:
        edge = now - MINUTES_KEPT_S
        for bucket in [b for b in self.buckets if b[0] < edge and b[0] % 3600]:
            counts = self.buckets.pop(bucket)
            hour = self.buckets[bucket[0] // 3600 * 3600, bucket[1], bucket[2]]
            for i, n in enumerate(counts):
                hour[i] += n

    def _write_snapshot(self, absorbed: list[str]) -> None:
        data = {"absorbed": absorbed, "buckets": [[*b, *c] for b, c in sorted(self.buckets.items())]}
        tmp = self.dir / (SNAPSHOT + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(data, separators=(",", ":")).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / SNAPSHOT)
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
