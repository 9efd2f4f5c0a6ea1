"""JSON logs (``[manager] log_format = "json"``): one JSON object per line, from every process.

The manager puts the format in its own environment (``LOG_FORMAT_ENV``) at start, so every
child it execs inherits it — gateways, engines, workers, and warm standbys, which are exec'd
with their member's environment and so know the format before they know their role.
``servectl.proc.setup_child_logging`` installs ``JsonFormatter`` on the root logger and routes
vLLM's own ``vllm`` logger through it (``route_vllm_logs``). What a child writes to its output
outside logging (a progress bar, a C library's print) is wrapped into an object of the same
shape by the manager as it reads the pipe (``wrap_line``), so every line of a log is JSON.

Fields: ``time`` (ISO 8601 UTC, ms), ``level``, ``component``, ``model`` (null where none),
``logger``, ``message``, ``pid``; ``request_id`` where the record has one; ``trace_id`` and
``span_id`` with tracing on, of the span current where the record was made (a gateway's line about
a request carries its trace: servectl/tracing); ``exc`` for a traceback; and a record's own
``fields`` (the access log's method, path, status, ...).
No vLLM import here: the manager and the gateway use it too.
"""

from __future__ import annotations

import json
import logging
import os
import time

LOG_FORMAT_ENV = "SERVECTL_LOG_FORMAT"
OUTPUT_LOGGER = "output"  # the ``logger`` of a line a child wrote outside logging


def json_logs() -> bool:
    return os.environ.get(LOG_FORMAT_ENV) == "json"


def iso_time(t: float) -> str:
    """``2026-12-04T05:01:02.345Z``."""
    ms = int(t * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{ms:03d}Z"


# Characters that json.dumps keeps raw with ensure_ascii=False but that some readers split lines
# at (Python's str.splitlines, JavaScript): escaped, so an object is one line for every reader.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def dumps(obj: dict) -> str:
    # Non-ASCII kept as it is (the files are UTF-8); a newline inside a value is escaped, so an
    # object is always one line. Anything not JSON-able (a path, an enum) is shown as str().
    return json.dumps(obj, ensure_ascii=False, default=str).translate(_LINE_BREAKS)


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str, model: str | None = None):
        super().__init__()
        self.component = component
        self.model = model
        from servectl import tracing

        self.traced = tracing.endpoint() is not None  # off: no OpenTelemetry import, no lookup

    def format(self, record: logging.LogRecord) -> str:
        obj = {"time": iso_time(record.created), "level": record.levelname, "component": self.component,
               "model": self.model, "logger": record.name, "message": record.getMessage(), "pid": record.process}
        rid = getattr(record, "request_id", None)
        if rid is not None:
            obj["request_id"] = rid
        fields = dict(getattr(record, "fields", None) or {})
        if obj["model"] is None:  # a request's model fills a component's missing one (the gateway's)
            obj["model"] = fields.pop("model", None)
        for key, value in fields.items():
            obj.setdefault(key, value)  # a record's own fields never replace the common ones
        if self.traced and "trace_id" not in obj:
            obj.update(current_trace())
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exc"] = record.exc_text
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return dumps(obj)


def current_trace() -> dict:
    """The current span's ids (tracing on), as the log fields name them; {} outside any span."""
    try:
        from opentelemetry import trace
    except ImportError:  # tracing configured without the SDK (servectl.tracing.start said so)
        return {}
    from servectl.tracing.w3c import log_ids

    return log_ids(trace.get_current_span())


def is_json_line(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def wrap_line(line: str, component: str, model: str | None, pid: int | None, at: float | None = None) -> str:
    """A line a child wrote outside logging, as the object its records are (read by the manager)."""
    return dumps({"time": iso_time(time.time() if at is None else at), "level": "INFO", "component": component,
                  "model": model, "logger": OUTPUT_LOGGER, "message": line, "pid": pid})


def route_vllm_logs() -> None:
    """vLLM's records through our root handler: vLLM configures its ``vllm`` logger with a
    handler of its own (vllm/logger.py: at import, and again from ``LLMEngine``'s config) unless
    ``VLLM_CONFIGURE_LOGGING=0``; with it off, ``vllm`` propagates to the root like any logger.
    Set here before vLLM is imported (read lazily by vLLM, each time), and any handler it already
    added is removed (vLLM imported before logging was set up). An operator who gave vLLM a
    logging file of their own (``VLLM_LOGGING_CONFIG_PATH``) keeps it: vLLM refuses that file
    with configuring off."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    vllm_log = logging.getLogger("vllm")
    for handler in list(vllm_log.handlers):
        vllm_log.removeHandler(handler)
    vllm_log.propagate = True
