"""Issue 35 (its count cap): with `max_loaded_models = 2`, three copies of the bundled model.

`a` is pinned, `b` and `c` are not. At start `a` and `b` load and `c` stays released. A
request for `c` releases `b` (the least recently used that is not pinned) and is answered; one
for `b` then releases `c`. A model with a request in flight is never released: with a long
stream running on `b`, a request for `c` waits until that stream is over. Every answer is the
one the same request gets from `a` (three copies of one model, temperature 0); no client
error; at most six starts and releases in all.
"""

from __future__ import annotations

import threading
import time

import pytest

from conftest import DEFAULT_MODEL_DIR, DaemonFactory, http, requests_running, wait_for

CONFIG = ("[gateway]\nhold_timeout_s = 180\n"
          "[manager]\nwarm_standby = false\nmax_loaded_models = 2\nfreeze_grace_s = 0.5\n" + "".join(
              f'[[models]]\nname = "{name}"\nmodel = "{DEFAULT_MODEL_DIR}"\n{extra}'
              for name, extra in (("a", "pinned = true\n"), ("b", ""), ("c", ""))))
BODY = {"prompt": "def ", "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "max-loaded") as make:
        yield make(CONFIG)


def states(d) -> dict[str, str]:
    return {m.name: str(m.state) for m in d.status().models}


def ask(d, model: str, **kw) -> str:
    r = http(d, "POST", "/v1/completions", {**BODY, **kw, "model": model}, key=None, timeout=300)
    assert r.status == 200, (model, r.status, r.text)
    return r.json()["choices"][0]["text"]


def test_at_start_the_models_beyond_the_cap_stay_released(d):
    assert states(d) == {"a": "ready", "b": "ready", "c": "released"}
    (c,) = [m for m in d.status().models if m.name == "c"]
    assert "max_loaded_models = 2" in (c.reason or "")


def test_a_request_for_a_released_model_releases_the_least_recently_used_unpinned_one(d):
    expected = ask(d, "a")
    assert ask(d, "c") == expected
    assert states(d) == {"a": "ready", "b": "released", "c": "ready"}
    assert ask(d, "b") == expected
    assert states(d) == {"a": "ready", "b": "ready", "c": "released"}
    log = d.log("manager")
    assert "model b: evicted: model c needs room" in log and "model c: evicted: model b needs room" in log


def test_a_model_with_a_request_in_flight_is_never_released(d):
    """b streams a long answer; c's request waits for room until b's stream is over."""
    assert states(d)["b"] == "ready"
    long_answer: list[str] = []
    done_at: list[float] = []

    def stream() -> None:
        long_answer.append(ask(d, "b", max_tokens=400, ignore_eos=True))
        done_at.append(time.monotonic())

    t = threading.Thread(target=stream)
    t.start()
    wait_for(lambda: requests_running(d, "b") > 0, 60, interval=0.05, what="b's request in flight")
    assert ask(d, "c") == ask(d, "a")
    answered_at = time.monotonic()
    t.join(300)
    assert long_answer and len(long_answer[0]) > 0
    assert done_at and done_at[0] <= answered_at, "c was answered while b's request was in flight"
    assert states(d) == {"a": "ready", "b": "released", "c": "ready"}
    swaps = d.log("manager").count("needs room")
    assert swaps <= 6, swaps
