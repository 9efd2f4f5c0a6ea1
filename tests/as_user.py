"""Acting as another user in a test (the tests run as root): a forked child that setuid()s first.

Everything the function needs must already be imported in the parent: the child
is ``nobody``, and may not be able to read what an import would open.
"""

from __future__ import annotations

import os
import pickle

NOBODY = 65534


def start_as(uid: int, fn, *args) -> tuple[int, int]:
    """Fork a child that becomes ``uid`` (its groups dropped, its gid ``uid``) and runs ``fn(*args)``;
    returns its pid and the read end its result comes on (``finish``)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                result = ("ok", fn(*args))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                import traceback

                result = ("raised", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            with os.fdopen(w, "wb") as out:
                pickle.dump(result, out)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def finish(pid: int, r: int, uid: int = NOBODY):
    """The child's result; what it raised fails the test, with its traceback."""
    with os.fdopen(r, "rb") as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind != "ok":
        raise AssertionError(f"as uid {uid}: {value}")
    return value


def run_as(uid: int, fn, *args):
    return finish(*start_as(uid, fn, *args), uid=uid)
