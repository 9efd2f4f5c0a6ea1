"""``QuietBatchProcessor``: spans batched and exported off the hot path, nothing awake while idle.

The SDK's ``BatchSpanProcessor`` wakes its thread every ``OTEL_BSP_SCHEDULE_DELAY`` (5 s) whether
or not a span waits: an idle servectl tree would tick in every process. Here the export thread
sleeps on a condition with no timeout while the queue is empty; the first span queued starts the
delay, a full batch cuts it short, and the thread exports on its own, never on the thread that
ended the span (a gateway's event loop, the engine's step loop). The SDK's variables size it:
``OTEL_BSP_SCHEDULE_DELAY``, ``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``,
``OTEL_BSP_EXPORT_TIMEOUT``; the delay defaults to 1 s, not the SDK's 5 s: a member of a group
is SIGKILLed when another dies, and what it had not exported yet is lost with it (the engine
flushes on an orderly stop). A full queue drops the newest span (counted, logged once).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor

log = logging.getLogger("servectl.tracing")
DEFAULT_DELAY_MS = 1000
SHUTDOWN_WAIT_S = 5.0


def _env_ms(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default))) / 1000
    except ValueError:
        return default / 1000


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


class QuietBatchProcessor(SpanProcessor):
    """An OpenTelemetry ``SpanProcessor`` whose export thread sleeps while nothing waits."""

    def __init__(self, exporter: Any, delay_s: float | None = None, max_queue: int | None = None,
                 max_batch: int | None = None):
        self.exporter = exporter
        self.delay_s = _env_ms("OTEL_BSP_SCHEDULE_DELAY", DEFAULT_DELAY_MS) if delay_s is None else delay_s
        self.max_queue = max_queue or _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.max_batch = min(max_batch or _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self.max_queue)
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.flushing = 0  # force_flush calls waiting for the queue to be exported
        self.exporting = 0  # batches taken off the queue and not yet exported
        self.exported_batches = 0
        self.dropped = 0
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="servectl-span-export", daemon=True)
        self.thread.start()

    # ---- the SDK's SpanProcessor interface -------------------------------------------------
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self.cond:
            if self.closed:
                return
            if len(self.queue) >= self.max_queue:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("span export queue full (%d): dropping spans (OTEL_BSP_MAX_QUEUE_SIZE)",
                                self.max_queue)
                return
            self.queue.append(span)
            if len(self.queue) == 1 or len(self.queue) >= self.max_batch:
                self.cond.notify_all()

    def shutdown(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        # Bounded: a collector that is down must not hold a process's exit (its spans are lost).
        self.thread.join(timeout=min(SHUTDOWN_WAIT_S, _env_ms("OTEL_BSP_EXPORT_TIMEOUT", 30000)))
        try:
            self.exporter.shutdown()
        except Exception:  # noqa: BLE001 - the spans are lost, the exit goes on
            log.debug("span exporter shutdown", exc_info=True)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export everything queued now; True once it is out (False past the timeout)."""
        deadline = time.monotonic() + timeout_millis / 1000
        with self.cond:
            self.flushing += 1
            self.cond.notify_all()
            try:
                while (self.queue or self.exporting) and not self.closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    # event-proof: a caller's bounded wait for the export thread's notify.
                    self.cond.wait(left)
                return True
            finally:
                self.flushing -= 1

    # ---- the export thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()  # no timeout: asleep until a span is queued
                if self.queue and len(self.queue) < self.max_batch and not self.closed and not self.flushing:
                    # event-proof: armed only while spans wait: more of them share one export.
                    self.cond.wait_for(lambda: len(self.queue) >= self.max_batch or self.closed
                                       or self.flushing > 0, timeout=self.delay_s)
                batch = [self.queue.popleft() for _ in range(min(self.max_batch, len(self.queue)))]
                self.exporting += 1
                closed = self.closed
            if batch:
                self._export(batch)
            with self.cond:
                self.exporting -= 1
                if not self.queue:
                    self.cond.notify_all()  # force_flush's waiters
                if closed and not self.queue:
                    return

    def _export(self, batch: list) -> None:
        try:
            self.exporter.export(batch)
            self.exported_batches += 1
        except Exception:  # noqa: BLE001 - a collector's failure costs those spans, never the process
            log.warning("exporting %d span(s) failed", len(batch), exc_info=True)
