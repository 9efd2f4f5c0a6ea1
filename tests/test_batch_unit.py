"""The Files and Batch APIs' pure parts (issue 59): input lines checked, results read back after
a crash, the store's records whole whatever happens, ids that are never paths, a batch line's
key and priority. No daemon, no vLLM."""

from __future__ import annotations

import json
import os

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api_gateway import batch_lines as L
from api_gateway import batch_store as S
from api_gateway.batch_runner import BatchAuth
from servectl.wire.engine import BATCH_PRIORITY
from api_gateway.keys import OPEN, Access, KeyRing, fingerprint
from api_gateway.tenancy import PRIORITY_KINDS, KeyGate
from servectl import config as C

pytestmark = pytest.mark.unit
CHAT = "/v1/chat/completions"


def line(custom_id, url=CHAT, method="POST", body=None) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": body if body is not None else {"model": "m", "messages": []}}).encode()


def test_good_lines_are_sent_bad_ones_answered_in_the_error_file_and_duplicates_fail_the_batch():
    data = b"\n".join([line("a"), b"", b"{oops", line("b", url="/v1/completions"), line("c", method="GET"),
                       json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode(), line("d", body=[1]),
                       line("e", body={"model": "m", "stream": True}), line("f"), b"  "])
    checked = L.check(data, CHAT)
    assert [(x.number, x.custom_id) for x in checked.lines] == [(1, "a"), (9, "f")]
    assert checked.model == "m" and not checked.fatal
    bad = [json.loads(b) for b in checked.bad]
    assert [(b["custom_id"], b["error"]["code"], b["error"]["line"]) for b in bad] == [
        (None, "invalid_json_line", 3), ("b", "mismatched_url", 4), ("c", "invalid_method", 5),
        (None, "missing_required_parameter", 6), ("d", "invalid_request", 7), ("e", "invalid_request", 8)]
    assert all(b["response"] is None and b["id"].startswith("batch_req_") for b in bad)
    dup = L.check(b"\n".join([line("a"), line("b"), line("a")]), CHAT)
    assert [(e.code, e.line) for e in dup.fatal] == [("duplicate_custom_id", 3)] and "line 1" in dup.fatal[0].message
    # A bad line's custom_id counts too: its answer must not stand for a good line's.
    assert L.check(b"\n".join([line("a", url="/x"), line("a")]), CHAT).fatal[0].line == 2


def test_results_read_back_skip_a_line_cut_by_a_crash():
    ok = L.output_line("a", 200, "r1", {"x": 1})
    failed = L.output_line("b", 400, "r2", {"error": {}})
    error = L.error_line("c", "batch_expired", "late")
    data = ok + failed + error + ok[:17]
    done, good, bad, end = L.answered(data)
    assert done == {"a", "b", "c"} and (good, bad) == (1, 2) and end == len(data) - 17
    assert L.answered(b"")[0] == set()


@given(st.lists(st.tuples(st.text(min_size=1, max_size=20), st.sampled_from([200, 201, 400, 404, 500])), max_size=30),
       st.integers(min_value=0, max_value=200))
def test_a_results_file_cut_anywhere_gives_exactly_its_whole_lines(answers, cut):
    lines = [L.output_line(cid, status, "r", {"n": i}) for i, (cid, status) in enumerate(answers)]
    data = b"".join(lines)
    cut_at = max(0, len(data) - cut)
    done, good, bad, end = L.answered(data[:cut_at])
    whole = []
    total = 0
    for raw, answer in zip(lines, answers):
        if total + len(raw) > cut_at:
            break
        total += len(raw)
        whole.append(answer)
    assert end == total and done == {cid for cid, _ in whole}
    assert good == sum(200 <= s < 300 for _, s in whole) and bad == len(whole) - good


def test_a_record_is_the_old_or_the_new_one_whatever_is_left_of_a_write(tmp_path, monkeypatch):
    store = S.Store(tmp_path)
    record = S.BatchRecord(id="batch_1", owner="k", runner=0, endpoint=CHAT, input_file_id="file-1",
                           completion_window="24h", created_at=1, expires_at=2)
    store.put_batch(record)
    record.status = S.IN_PROGRESS

    def crash(*a):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.put_batch(record)
    monkeypatch.undo()
    assert store.get_batch("batch_1").status == S.VALIDATING  # the old one, whole
    store.put_batch(record, durable=False)
    assert store.get_batch("batch_1").status == S.IN_PROGRESS


def test_a_cancel_asked_elsewhere_shows_as_cancelling_and_the_runner_reads_it(tmp_path):
    store = S.Store(tmp_path)
    record = S.BatchRecord(id="batch_2", owner="k", runner=1, endpoint=CHAT, input_file_id="file-1",
                           completion_window="24h", created_at=1, expires_at=2, status=S.IN_PROGRESS)
    store.put_batch(record)
    store.ask_cancel("batch_2")
    assert store.get_batch("batch_2").status == S.CANCELLING and store.get_batch("batch_2").cancelling_at
    assert store.get_batch("batch_2", as_written=True).status == S.IN_PROGRESS
    assert S.batch_object(store.get_batch("batch_2"))["status"] == "cancelling"


@pytest.mark.parametrize("name", ["../x", "a/b", "", "x" * 65, "é", "file-1.json", "."])
def test_an_id_is_never_a_path(tmp_path, name):
    store = S.Store(tmp_path)
    assert store.get_file(name) is None and store.get_batch(name) is None


def test_files_are_listed_once_whole_and_expire(tmp_path):
    store = S.Store(tmp_path)
    upload = store.upload_path()
    upload.write_bytes(b"x\n")
    store.add_file(upload, S.FileRecord(id="file-a", bytes=2, created_at=1, filename="a", purpose="batch",
                                        owner="k", expires_at=100))
    assert not upload.exists() and store.file_data("file-a").read_bytes() == b"x\n"
    assert [r.id for r in store.list_files()] == ["file-a"] and store.stored_bytes() > 2
    assert S.file_object(store.get_file("file-a"))["object"] == "file"
    assert store.sweep(99) == 0 and store.sweep(100) == 1
    assert store.get_file("file-a") is None and not store.file_data("file-a").exists()


def test_result_file_ids_are_the_same_each_time():
    assert S.result_file_id("batch_x", "output") == S.result_file_id("batch_x", "output")
    assert S.result_file_id("batch_x", "output") != S.result_file_id("batch_x", "error")


def test_a_batch_runs_as_its_key_as_configured_now():
    named = C.NamedKey(name="team", key="sk-team")
    ring = KeyRing(["sk-plain"], ["sk-admin"], [named])
    assert ring.by_label("team").named is named
    assert ring.by_label(fingerprint("sk-plain")).access is Access.API
    assert ring.by_label(fingerprint("sk-admin")).access is Access.ADMIN
    assert ring.by_label("gone") is None and ring.by_label(OPEN.label) is None
    assert KeyRing([], []).by_label(OPEN.label) is OPEN
    auth = BatchAuth(ring.by_label)
    assert auth.key_of(auth.secret, "team").label == "team"
    assert auth.key_of("not-the-secret", "team") is None and auth.key_of(auth.secret, "gone") is None


class Request(dict):
    pass


@pytest.mark.parametrize("fair", [True, False])
@pytest.mark.parametrize("kind", ["chat", "completion", "embeddings", "messages"])
def test_a_batch_line_goes_after_every_interactive_request(fair, kind):
    gate = KeyGate(manager=None, fair_share=fair)
    request = Request(key=OPEN, batch=True)
    forward = {"priority": -5}
    tag = gate.prioritise(request, kind, forward, 1)
    if kind in PRIORITY_KINDS:
        assert tag is None and forward["priority"] == BATCH_PRIORITY
    else:
        assert tag == BATCH_PRIORITY
    # An interactive request of the same key: far ahead of it.
    other = {"priority": 10}
    KeyGate(manager=None, fair_share=fair).prioritise(Request(key=OPEN, counted=None), "chat", other, 1)
    assert other.get("priority", 0) < BATCH_PRIORITY


def test_every_record_round_trips_as_json():
    record = S.BatchRecord(id="batch_3", owner="k", runner=0, endpoint=CHAT, input_file_id="f",
                           completion_window="24h", created_at=1, expires_at=2,
                           errors=[S.BatchError(code="c", message="m", line=3)], metadata={"a": "b"})
    again = msgspec.json.decode(msgspec.json.encode(record), type=S.BatchRecord)
    assert again == record
    assert S.batch_object(again)["errors"]["data"] == [{"code": "c", "message": "m", "line": 3}]


def test_one_runner_a_batch_the_lock_is_taken_when_its_holder_lets_go(tmp_path):
    import threading

    store = S.Store(tmp_path)
    held = store.lock("batch_l")
    assert held is not None and store.lock("batch_l") is None  # (another open file: another runner)
    got = threading.Event()
    fds = []
    store.wait_lock("batch_l", lambda fd: (fds.append(fd), got.set()))
    assert not got.wait(0.2)
    os.close(held)
    assert got.wait(10) and fds[0] is not None
    os.close(fds[0])


def test_a_sweep_keeps_a_running_batchs_input_and_removes_what_a_crash_left(tmp_path):
    store = S.Store(tmp_path)
    for fid in ("file-in", "file-old"):
        upload = store.upload_path()
        upload.write_bytes(b"x\n")
        store.add_file(upload, S.FileRecord(id=fid, bytes=2, created_at=1, filename="a", purpose="batch",
                                            owner="k", expires_at=10))
    store.put_batch(S.BatchRecord(id="batch_r", owner="k", runner=0, endpoint=CHAT, input_file_id="file-in",
                                  completion_window="24h", created_at=1, expires_at=99, status=S.IN_PROGRESS))
    leftover, orphan = store.files / ".upload-1-ab", store.files / "file-gone.data"
    leftover.write_bytes(b"half")
    orphan.write_bytes(b"no record")
    fresh = store.files / ".upload-2-cd"
    fresh.write_bytes(b"being written")
    old = 1_000.0
    os.utime(leftover, (old, old))
    os.utime(orphan, (old, old))
    store.sweep(now=old + S.LEFTOVER_S + 1)
    assert store.get_file("file-in") is not None and store.get_file("file-old") is None
    assert not leftover.exists() and not orphan.exists() and fresh.exists()


def test_progress_is_shown_while_running_and_never_needed(tmp_path):
    store = S.Store(tmp_path)
    record = S.BatchRecord(id="batch_p", owner="k", runner=0, endpoint=CHAT, input_file_id="f",
                           completion_window="24h", created_at=1, expires_at=2, status=S.IN_PROGRESS, total=5)
    store.put_batch(record)
    record.completed, record.failed = 3, 1
    store.put_progress(record)
    assert (store.get_batch("batch_p").completed, store.get_batch("batch_p").failed) == (3, 1)
    store.batch_path("batch_p", "progress").write_bytes(b"")  # a power loss's empty file: the record stands
    assert store.get_batch("batch_p").completed == 0


def test_an_append_is_whole_or_not_at_all(tmp_path, monkeypatch):
    from api_gateway.batch_runner import append

    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    append(fd, b"first\n")
    real = os.write
    calls = []

    def short_then_full_disk(f, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real(f, bytes(data[:3]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_full_disk)
    with pytest.raises(OSError):
        append(fd, b"second\n")
    monkeypatch.undo()
    append(fd, b"third\n")
    os.close(fd)
    assert path.read_bytes() == b"first\nthird\n"


def test_a_finish_cut_short_anywhere_ends_the_same(tmp_path):
    """The end is written first; results are linked, then the ended record, then the batch's own
    results go: whatever a crash leaves, finishing again gives the same files and counts."""
    from api_gateway.batch_runner import BatchRunner

    store = S.Store(tmp_path)
    runner = BatchRunner(store, 0, 1, lambda: C.BatchConfig(), BatchAuth(lambda label: None), "")
    record = S.BatchRecord(id="batch_f", owner="k", runner=0, endpoint=CHAT, input_file_id="gone",
                           completion_window="24h", created_at=1, expires_at=2, status=S.FINALIZING,
                           ending=S.CANCELLED, completed=2, failed=1, total=9)
    store.put_batch(record)
    out = L.output_line("a", 200, "r", {}) + L.output_line("b", 200, "r", {})
    store.batch_path("batch_f", "output").write_bytes(out)
    store.batch_path("batch_f", "errors").write_bytes(L.output_line("c", 400, "r", {}))
    runner._results_files(record)  # a crash after publishing, before the record
    again = store.get_batch("batch_f", as_written=True)
    assert again.status == S.FINALIZING
    runner._finish(again)
    ended = store.get_batch("batch_f")
    assert (ended.status, ended.completed, ended.failed) == (S.CANCELLED, 2, 1)
    assert store.file_data(ended.output_file_id).read_bytes() == out
    assert store.get_file(ended.error_file_id).bytes > 0
    assert not store.batch_path("batch_f", "output").exists()


def test_a_batch_past_its_window_expires_its_lines_unanswered_and_keeps_the_answered(tmp_path):
    """A runner that starts after the completion window (the daemon was down) sends nothing: the
    answered lines stay, the rest are answered `batch_expired` in the error file."""
    import asyncio

    from api_gateway.batch_runner import BatchRunner

    store = S.Store(tmp_path)
    upload = store.upload_path()
    upload.write_bytes(b"\n".join(line(c) for c in ("a", "b", "c")) + b"\n")
    store.add_file(upload, S.FileRecord(id="file-x", bytes=1, created_at=1, filename="x", purpose="batch", owner="k"))
    record = S.BatchRecord(id="batch_x", owner="k", runner=0, endpoint=CHAT, input_file_id="file-x",
                           completion_window="24h", created_at=1, expires_at=2, status=S.IN_PROGRESS, total=3)
    store.put_batch(record)
    store.batch_path("batch_x", "output").write_bytes(L.output_line("b", 200, "r", {"ok": 1}))
    runner = BatchRunner(store, 0, 1, lambda: C.BatchConfig(), BatchAuth(lambda label: None), "/nonexistent")

    async def run() -> None:
        runner.run(store.get_batch("batch_x"))
        await asyncio.gather(*runner.tasks.values())

    asyncio.run(run())
    ended = store.get_batch("batch_x")
    assert (ended.status, ended.completed, ended.failed) == (S.EXPIRED, 1, 2) and ended.expired_at
    errors = [json.loads(x) for x in store.file_data(ended.error_file_id).read_bytes().splitlines()]
    assert sorted(e["custom_id"] for e in errors) == ["a", "c"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert [json.loads(x)["custom_id"] for x in store.file_data(ended.output_file_id).read_bytes().splitlines()] == ["b"]
    assert not store.batch_path("batch_x", "output").exists()  # the batch's own, once it has ended
