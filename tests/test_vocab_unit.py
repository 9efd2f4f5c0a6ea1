"""The shared words (servectl/wire/vocab.py): checked at decode, never spelled in product code.

A state, mode or kind no process knows is a decode error (receivers log and drop
the frame), and product code compares enum members: a literal "ready" or a bare
78 compared with something is the spelling this module replaced.
"""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from servectl.wire import control as CP
from servectl.wire import status as WS
from servectl.wire import spawn as SP
from servectl.wire.vocab import (ARMED, AVAILABLE, ChildState, EventKind, ExitCode, IdleMode, ManagerState,
                                 ModelState)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("servectl", "manager", "engine_core", "api_gateway")
VOCAB = ROOT / "servectl" / "wire" / "vocab.py"
# Every word of the vocabularies (the state words, modes and kinds compared as strings before).
WORDS = {m.value for enum in (ModelState, ChildState, IdleMode, EventKind) for m in enum} | {ARMED}
EXIT_CODES = {int(c) for c in ExitCode} - {0, 1}
# What holds an exit status where it is compared (a bare code beside one of these is a spelling).
EXIT_NAMES = {"returncode", "exit_code", "exit_status", "si_status", "code"}


def test_the_values_are_the_words_status_shows():
    assert {str(s) for s in AVAILABLE} == {"ready", "released", "asleep"}
    assert ChildState.FROZEN == "idle (frozen)" and f"{ModelState.READY}" == "ready"
    assert msgspec.json.encode(WS.ModelStatus(name="m", state=ModelState.ASLEEP, frozen=False, incarnation="")) \
        .startswith(b'{"name":"m","state":"asleep"')
    assert ExitCode.PERMANENT == 78 and ExitCode.HUNG == 75 and ExitCode.STEP_FAILED == 70


@pytest.mark.parametrize("frame, decoder", [
    (CP.encoder.encode(CP.StatusReply(version=1, instance="i", manager_pid=1, started_at=0.0, state="running",
                                      port=1, host="h", state_dir="/s", children=[],
                                      models=[WS.ModelStatus(name="m", state="sleeping", frozen=False,
                                                             incarnation="")])), CP.control_out_decoder),
    (CP.encoder.encode(CP.StatusReply(version=1, instance="i", manager_pid=1, started_at=0.0, state="resting",
                                      port=1, host="h", state_dir="/s", children=[], models=[])),
     CP.control_out_decoder),
    (CP.encoder.encode(WS.Event(component="model:m", kind="model", model="m", state="exploded", pid=None,
                                time=0.0)), WS.event_decoder),
    (CP.encoder.encode(WS.Event(component="x:m", kind="planet", model="m", state="ready", pid=None, time=0.0)),
     WS.event_decoder),
    (CP.encoder.encode(CP.GroupReleased(model="m", incarnation="i", released=True, mode="hibernate")),
     CP.control_in_decoder),
    (CP.encoder.encode(CP.Release(mode="evict")), CP.to_engine_decoder),
    (CP.encoder.encode(CP.ChildReady(component="engine_core:m", pid=1, idle_release="nap")), CP.control_in_decoder),
])
def test_a_word_no_process_knows_is_rejected_at_decode(frame, decoder):
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(frame)


def test_decoded_words_are_members():
    ev = WS.event_decoder.decode(CP.encoder.encode(WS.Event(component="model:m", kind="model", model="m",
                                                            state="asleep", pid=None, time=0.0)))
    assert ev.kind is EventKind.MODEL and ModelState(ev.state) is ModelState.ASLEEP
    spec = msgspec.json.decode(msgspec.json.encode(SP.EngineSpec(
        model=SP.ModelConfig(name="m", model="/m"), runtime_dir="/r", incarnation="i", freezing=False,
        freeze_grace_s=1.0, worker_reply_timeout_s=1.0, idle_release="sleep")), type=SP.EngineSpec)
    assert spec.idle_release is IdleMode.SLEEP
    assert SP.parse_component("engine_core:m").kind is EventKind.ENGINE
    status = CP.control_out_decoder.decode(CP.encoder.encode(CP.StatusReply(
        version=1, instance="i", manager_pid=1, started_at=0.0, state="running", port=1, host="h", state_dir="/s",
        children=[], models=[])))
    assert status.state is ManagerState.RUNNING


def _names(node: ast.AST) -> set[str]:
    """The names and attribute names an expression mentions."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _literal_words(node: ast.AST) -> list[str]:
    """The vocabulary words a literal (a string, or a tuple/set/list/frozenset of them) spells."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in WORDS else []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set") \
            and node.args:
        return _literal_words(node.args[0])
    if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
        return [w for elt in node.elts for w in _literal_words(elt)]
    return []


def _exit_literal(node: ast.AST) -> int | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return None
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value in EXIT_CODES:
        return node.value
    return None


def spellings(source: str, filename: str) -> list[str]:
    """Each comparison in ``source`` of a vocabulary word or an exit code written out."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            left, right = operands[i], operands[i + 1]
            if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)):
                words = _literal_words(left) + _literal_words(right)
                # "engine_core" is also a module's name (a standby's Role.module): not the kind.
                if words and not (_names(left) | _names(right)) & {"module"}:
                    found.append(f"{filename}:{node.lineno}: compares the word(s) {words} (use the enum)")
                for lit, other in ((left, right), (right, left)):
                    code = _exit_literal(lit)
                    if code is not None and _names(other) & EXIT_NAMES:
                        found.append(f"{filename}:{node.lineno}: compares exit code {code} (use ExitCode)")
    return found


def test_product_code_compares_members_not_spellings():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == VOCAB or "model" in path.relative_to(ROOT).parts[1:2]:
                continue
            found += spellings(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_the_check_finds_each_spelling():
    bad = ('if state == "ready": pass\n'
           'x = kind != "model"\n'
           'y = mode in ("unload", "sleep")\n'
           'z = s not in frozenset({"failed", "backoff"})\n'
           'w = proc.returncode == 78\n'
           'v = child.exit_code != 75\n')
    assert len(spellings(bad, "bad.py")) == 6
    good = ('if state is ModelState.READY: pass\n'
            'n = len(frames) != 2\n'
            'm = body.get("stream") == "yes"\n'
            'c = proc.returncode == 0\n'
            'k = child.exit_code == ExitCode.PERMANENT\n')
    assert spellings(good, "good.py") == []
