"""Every timed wait in product code says why it is no poll (`# event-proof: <why>`).

An idle servectl tree makes no wake-ups (docs/ARCHITECTURE.md, "Event-proof
waits"): everything waits on an event, and the few waits that carry a time (a
deadline, a bounded spin, systemd's watchdog) say so where they are written.
This test reads the product packages with ``ast`` and ``tokenize`` and names,
as file:line, every call that waits for a time or arms a timer without an
``# event-proof:`` comment on its statement's lines or in the comment lines
just above it. It imports nothing it reads.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("servectl", "manager", "engine_core", "api_gateway")
MARK = "event-proof:"

# A wait for a time whatever its arguments (a sleep, a timer armed).
ALWAYS = {("time", "sleep"), ("asyncio", "sleep"), ("threading", "Timer")}
ALWAYS_ATTRS = {"call_later", "call_at"}  # loop.call_later / call_at on any loop
ALWAYS_NAMES = {"sleep", "Timer"}  # `from time import sleep`, `from threading import Timer`
# A wait bounded by a time when given one (a positional argument at that index, or the keyword).
TIMEOUT_ARG = {
    "wait_for": (1, "timeout"),  # asyncio.wait_for(aw, timeout)
    "timeout": (0, "delay"),  # asyncio.timeout(delay)
    "timeout_at": (0, "when"),
    "wait": (None, "timeout"),  # asyncio.wait(fs, timeout=...)
    "select": (3, "timeout"),  # select.select(r, w, x, timeout)
}
POLL_ATTRS = {"poll"}  # select.poll / epoll / a ZeroMQ poller or socket: .poll(timeout)


def _given(node: ast.Call, index: int | None, keyword: str) -> ast.expr | None:
    for kw in node.keywords:
        if kw.arg == keyword:
            return kw.value
    if index is not None and len(node.args) > index:
        return node.args[index]
    return None


def _is_none(expr: ast.expr | None) -> bool:
    return expr is None or (isinstance(expr, ast.Constant) and expr.value is None)


def timed(node: ast.Call) -> str | None:
    """What kind of timed wait this call is, or None."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id if func.id in ALWAYS_NAMES else None
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value.id if isinstance(func.value, ast.Name) else None
    name = func.attr
    if (owner, name) in ALWAYS or name in ALWAYS_ATTRS:
        return f"{owner + '.' if owner else ''}{name}"
    if name in TIMEOUT_ARG and (owner in ("asyncio", "select") or name in ("wait_for",)):
        if name == "select" and owner != "select":
            return None
        index, keyword = TIMEOUT_ARG[name]
        return None if _is_none(_given(node, index, keyword)) else f"{owner}.{name} with a timeout"
    if name in POLL_ATTRS:
        arg = _given(node, 0, "timeout")
        zero = isinstance(arg, ast.Constant) and arg.value == 0  # a check that waits for nothing
        return None if _is_none(arg) or zero else f".{name} with a timeout"
    return None


def _comments(source: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def findings(source: str, path: str = "<string>") -> list[str]:
    """``path:line: what`` for every timed wait in ``source`` that carries no event-proof comment."""
    tree = ast.parse(source)
    # Each timed call with the first line of the statement it is part of.
    calls: list[tuple[ast.Call, str, int]] = []
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt):
            continue
        todo = [c for c in ast.iter_child_nodes(stmt) if not isinstance(c, ast.stmt)]
        while todo:  # the statement's own expressions, not the statements nested in its body
            node = todo.pop()
            if isinstance(node, ast.Call) and (what := timed(node)) is not None:
                calls.append((node, what, stmt.lineno))
            todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt))
    if not calls:
        return []
    comments = _comments(source)
    lines = source.splitlines()
    out = []
    for node, what, stmt_line in sorted(calls, key=lambda c: (c[0].lineno, c[0].col_offset)):
        first = min(stmt_line, node.lineno)
        marked = any(MARK in comments.get(n, "") for n in range(first, node.end_lineno + 1))
        above = first - 1
        while not marked and above >= 1 and lines[above - 1].strip().startswith("#"):
            marked = MARK in comments.get(above, "")
            above -= 1
        if not marked:
            out.append(f"{path}:{node.lineno}: {what} without `# {MARK} <why>`")
    return out


def product_files() -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py"))


def test_every_timed_wait_in_product_code_says_why_it_is_no_poll():
    missing = [f for path in product_files()
               for f in findings(path.read_text(), str(path.relative_to(ROOT)))]
    assert not missing, "\n".join(missing)


def test_the_checker_reads_the_product_packages():
    files = {str(p.relative_to(ROOT)) for p in product_files()}
    assert {"manager/daemon.py", "api_gateway/engines.py", "servectl/cli/lifecycle.py"} <= files
    assert not any(f.startswith(("tests/", "bench/", "training/", "tools/")) for f in files)


BAD = '''
import asyncio, select, threading, time
from time import sleep

async def f(loop, ev, poller, sock):
    while True:
        time.sleep(0.1)
    await asyncio.sleep(1)
    loop.call_later(5, print)
    loop.call_at(loop.time() + 1, print)
    threading.Timer(1.0, print).start()
    sleep(2)
    await asyncio.wait_for(ev.wait(), 3)
    async with asyncio.timeout(2):
        pass
    select.select([sock], [], [], 0.5)
    poller.poll(100)
    done, _ = await asyncio.wait([ev], timeout=1)
'''


def test_the_checker_names_each_unmarked_wait_by_line():
    found = findings(BAD, "made_up.py")
    assert [f.split(":")[1] for f in found] == ["7", "8", "9", "10", "11", "12", "13", "14", "16", "17", "18"]
    assert found[0] == "made_up.py:7: time.sleep without `# event-proof: <why>`"


def test_a_comment_on_the_line_or_in_the_lines_just_above_marks_it():
    good = '''
import asyncio, time

async def f(loop, ev, poller):
    time.sleep(0.1)  # event-proof: a start-up retry
    # event-proof: a deadline armed only while a call is in flight,
    # spelled over two lines
    await asyncio.wait_for(
        ev.wait(), 3)
    async with asyncio.timeout(  # event-proof: bounded
            2):
        pass
    poller.poll(None)  # no timeout: blocks until an event, nothing to say
    poller.poll()
    poller.poll(0)  # a zero timeout waits for nothing
    await asyncio.wait_for(ev.wait(), None)
'''
    assert findings(good) == []
    # A comment that is not the convention, or one separated by code, marks nothing.
    assert len(findings("import time\n# a retry\ntime.sleep(1)\n")) == 1
    assert len(findings("import time\n# event-proof: x\ny = 1\ntime.sleep(1)\n")) == 1
    assert len(findings("import time\ntime.sleep(1)  # event_proof: typo\n")) == 1
