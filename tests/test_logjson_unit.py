"""JSON logs (issue 56, item 2) without a daemon: the formatter's fields, a traceback, non-ASCII
and newlines kept on one line, the manager's wrapping of a child's loose output, vLLM's logger
routed through the root handler, and `[manager] log_format` in the config."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from builders import config_error, config_from
from manager.logs import LogSink
from servectl.logjson import LOG_FORMAT_ENV, JsonFormatter, is_json_line, iso_time, wrap_line

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"time", "level", "component", "model", "logger", "message", "pid"}


def record(msg: str, *args, name: str = "api_gateway.access", level: int = logging.INFO, exc_info=None,
           **extra) -> logging.LogRecord:
    rec = logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)
    rec.__dict__.update(extra)
    return rec


def test_a_record_is_one_object_with_every_field():
    rec = record("%s done in %d ms", "load", 12, name="engine_core")
    rec.created = 1796360462.3456  # 2026-12-04T05:01:02.345Z
    line = JsonFormatter("engine_core:default", "default").format(rec)
    obj = json.loads(line)
    assert REQUIRED <= obj.keys()
    assert obj == {"time": "2026-12-04T05:01:02.345Z", "level": "INFO", "component": "engine_core:default",
                   "model": "default", "logger": "engine_core", "message": "load done in 12 ms",
                   "pid": os.getpid()}  # no request id, no traceback: not there at all


def test_the_access_logs_fields_and_request_id_are_fields():
    fields = {"method": "POST", "path": "/v1/completions", "status": 200, "model": "default",
              "prompt_tokens": 3, "completion_tokens": 4, "duration_ms": 12.5, "level": "NOT MINE"}
    obj = json.loads(JsonFormatter("gateway:0").format(record("POST ...", request_id="abc-1", fields=fields)))
    assert obj["request_id"] == "abc-1"
    assert obj["model"] == "default"  # the request's, where the component has none
    assert obj["level"] == "INFO"  # a record's fields never replace the common ones
    assert {k: obj[k] for k in fields if k != "level"} == {k: v for k, v in fields.items() if k != "level"}
    # A component's own model is not replaced by a record's.
    assert json.loads(JsonFormatter("engine_core:a", "a").format(record("x", fields={"model": "b"})))["model"] == "a"


def test_a_traceback_is_in_exc_and_the_line_stays_one_line():
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        rec = record("failed: %s", "step", level=logging.ERROR, exc_info=sys.exc_info())
    line = JsonFormatter("worker:default:0", "default").format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "ERROR" and obj["message"] == "failed: step"
    assert obj["exc"].startswith("Traceback (most recent call last)") and "ValueError: bad\nvalue" in obj["exc"]


def test_non_ascii_and_newlines_in_a_message_stay_one_line():
    message = "modèle «défaut» 模型\nsecond line\r\n\tthird\u2028fourth\x85fifth"
    line = JsonFormatter("manager").format(record(message))
    assert len(line.splitlines()) == 1  # U+2028 and NEL too: str.splitlines splits at them
    assert "模型" in line  # kept as it is: the files are UTF-8
    assert json.loads(line)["message"] == message


def test_iso_time_is_utc_with_milliseconds():
    assert iso_time(0) == "1970-01-01T00:00:00.000Z"
    assert iso_time(1796360462.9999) == "2026-12-04T05:01:02.999Z"


def test_the_manager_wraps_a_childs_loose_output_and_keeps_its_json_lines(tmp_path):
    sink = LogSink("worker:default@1:0", tmp_path / "worker.log", json_lines=True)
    sink.pid = 4321
    own = JsonFormatter("worker:default@1:0", "default").format(record("ready", name="vllm.worker"))
    sink.write(f"Loading weights: 100%|███| 1/1\n{own}\n{{not json}}\npartial".encode())
    sink.close()
    lines = (tmp_path / "worker.log").read_text().splitlines()
    assert len(lines) == 4 and lines[1] == own and sink.lines[1] == own
    objs = [json.loads(line) for line in lines]
    assert all(REQUIRED <= o.keys() for o in objs)
    assert [o["message"] for o in objs] == ["Loading weights: 100%|███| 1/1", "ready", "{not json}", "partial"]
    wrapped = objs[0]
    assert (wrapped["component"], wrapped["model"], wrapped["pid"], wrapped["logger"]) == \
        ("worker:default@1:0", "default", 4321, "output")
    assert is_json_line(own) and not is_json_line("{not json}") and not is_json_line("[1]")


def test_under_systemd_a_childs_object_reaches_the_journal_whole_after_its_component(tmp_path, capsys):
    sink = LogSink("engine_core:default", tmp_path / "e.log", journal=True, json_lines=True)
    own = JsonFormatter("engine_core:default", "default").format(record("ready", name="engine_core"))
    sink.write(f"{own}\nloose\n".encode())
    lines = capsys.readouterr().err.split("\n")[:-1]
    assert lines[0] == f"engine_core:default: {own}"
    prefix, _, obj = lines[1].partition(": ")
    assert prefix == "engine_core:default" and json.loads(obj)["message"] == "loose"
    assert not (tmp_path / "e.log").exists()  # the journal has them, not a file


def test_a_text_sink_writes_lines_as_they_are(tmp_path):
    sink = LogSink("gateway:0", tmp_path / "gw.log", json_lines=False)
    sink.write(b"plain line\n")
    assert (tmp_path / "gw.log").read_text() == "plain line\n"
    assert json.loads(wrap_line("x", "gateway:0", None, 1))["component"] == "gateway:0"


def test_child_logging_in_json_routes_vllms_own_logger_and_uncaught_exceptions():
    # A fresh interpreter (setup_child_logging changes the process's logging): a `vllm` logger
    # that already has a handler of its own (as vLLM's import gives it) is routed to the root's.
    code = textwrap.dedent("""
        import logging, sys
        own = logging.StreamHandler(sys.stdout)
        logging.getLogger("vllm").addHandler(own)
        logging.getLogger("vllm").propagate = False
        from servectl.proc import setup_child_logging
        log = setup_child_logging("worker[m:0]", "worker:m:0", "m")
        logging.getLogger("vllm.worker").info("from vllm")
        log.warning("ours")
        import os; print(os.environ.get("VLLM_CONFIGURE_LOGGING"), file=sys.stdout)
        raise RuntimeError("boom")
    """)
    env = {**os.environ, LOG_FORMAT_ENV: "json", "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.strip() == "0", proc.stdout  # vLLM's own handler is gone; it will not add one
    objs = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [(o["logger"], o["message"]) for o in objs] == [("vllm.worker", "from vllm"), ("worker[m:0]", "ours"),
                                                          ("worker[m:0]", "uncaught exception")]
    assert all(o["component"] == "worker:m:0" and o["model"] == "m" for o in objs)
    assert "RuntimeError: boom" in objs[-1]["exc"] and objs[-1]["level"] == "CRITICAL"


def test_child_logging_in_text_is_unchanged():
    code = "from servectl.proc import setup_child_logging; setup_child_logging('gateway[0]').info('hi')"
    env = {**os.environ, LOG_FORMAT_ENV: "text", "PYTHONPATH": str(ROOT)}
    env.pop("JOURNAL_STREAM", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stderr.strip().endswith("gateway[0] INFO hi") and not proc.stderr.startswith("{"), proc.stderr


def test_log_format_is_text_by_default_json_when_asked_and_nothing_else(tmp_path):
    assert config_from(tmp_path, "").manager.log_format == "text"
    assert config_from(tmp_path, '[manager]\nlog_format = "json"\n').manager.log_format == "json"
    msg = config_error(tmp_path, '[manager]\nlog_format = "xml"\n')
    assert "manager.log_format" in msg and "xml" not in msg.split("manager.log_format")[0], msg
    assert "manager.log_format" in config_error(tmp_path, "[manager]\nlog_format = 1\n")
