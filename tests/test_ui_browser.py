"""The status page (/ui) in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, installed by `python -m servectl.doctor --fix --tests`) driven through
selenium, against a real daemon with API and admin keys serving two models.

The tests share the daemon and run in order: each leaves it as it found it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import urllib.error
import urllib.request

import pytest

from conftest import DEFAULT_MODEL_DIR, DaemonFactory, context_switches, http, wait_for

API_KEY = "ui-api-key-0123456789abcdef"
ADMIN_KEY = "ui-admin-key-0123456789abcdef"
CONFIG = f"""[gateway]
api_keys = ["{API_KEY}"]
admin_keys = ["{ADMIN_KEY}"]
[manager]
warm_standby = false
freeze_grace_s = 1
[[models]]
name = "default"
model = "{DEFAULT_MODEL_DIR}"
[[models]]
name = "other"
model = "{DEFAULT_MODEL_DIR}"
"""


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "ui") as make:
        yield make(CONFIG, api_key=API_KEY)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver

    for tool in ("chromium", "chromedriver"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: python -m servectl.doctor --fix --tests installs it (Debian)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--no-first-run", "--disable-background-networking"):
        opts.add_argument(arg)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium's manager must not look for a driver online
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")))
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


def by_css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def sign_in(driver, d, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{d.base_url}/ui")
    if driver.title != "servectl: sign in":  # signed in already: out first, with the page's button
        wait_for(lambda: by_css(driver, "#signout:not([hidden])"), 20, what="the sign-out button")
        by_css(driver, "#signout button")[0].click()
        wait_for(lambda: driver.title == "servectl: sign in", 10, what="signed out")
    field = driver.find_element(By.NAME, "key")
    field.send_keys(key)
    field.submit()
    wait_for(lambda: driver.title == "servectl" and by_css(driver, "#processes tbody tr"), 20,
             what="the page with its snapshot", diagnose=lambda: driver.page_source[:2000])


# The page redraws its tables on every snapshot: read and click through the DOM as it is now.
def cells(driver, table: str, attr: str, name: str) -> list[str]:
    return driver.execute_script(
        "const r = document.querySelector(`#${arguments[0]} tbody tr[data-${arguments[1]}=\"${arguments[2]}\"]`);"
        "return r ? [...r.cells].map(c => c.innerText) : [];", table, attr, name)


def row(driver, table: str, attr: str, name: str) -> bool:
    return bool(cells(driver, table, attr, name))


def click(driver, selector: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException

    def clicked() -> bool:
        try:
            by_css(driver, selector)[0].click()
            return True
        except (StaleElementReferenceException, IndexError):
            return False
    wait_for(clicked, 20, interval=0.1, what=f"a click on {selector}")


def session_cookie(driver) -> str:
    """The session cookie as the browser holds it: ``name=value``."""
    c = next(c for c in driver.get_cookies() if c["name"].startswith("servectl_session"))
    return f"{c['name']}={c['value']}"


SAME_ORIGIN = {"Sec-Fetch-Site": "same-origin"}  # what the browser says of the page's own requests


def post_action(d, cookie: str | None, csrf: str | None, verb: str, model: str) -> int:
    headers = {"Content-Type": "application/json", **SAME_ORIGIN}
    if cookie:
        headers["Cookie"] = cookie
    if csrf:
        headers["X-CSRF-Token"] = csrf
    return http(d, "POST", "/ui/action", {"verb": verb, "model": model}, headers, key=None).status


def hello(d, cookie: str) -> dict:
    """The stream's first event for this session (what the page learns first)."""
    req = urllib.request.Request(f"{d.base_url}/ui/stream", headers={"Cookie": cookie, **SAME_ORIGIN})
    with urllib.request.urlopen(req, timeout=10) as resp:
        lines = []
        for line in resp:
            if line == b"\n" and lines:
                break
            lines.append(line.decode())
    return json.loads(next(line[6:] for line in lines if line.startswith("data: ")))


def test_a_key_is_needed_and_the_page_renders_every_model_and_process(d, browser):
    browser.get(f"{d.base_url}/ui")
    assert browser.title == "servectl: sign in"  # API keys configured: the page needs one
    assert http(d, "GET", "/ui/stream", headers=SAME_ORIGIN, key=None).status == 401
    sign_in(browser, d, API_KEY)
    st = d.status()
    wait_for(lambda: all(row(browser, "processes", "component", c.component) for c in st.children), 20,
             what="every process on the page")
    for c in st.children:
        assert str(c.pid) in cells(browser, "processes", "component", c.component), c
    for name in ("default", "other"):
        assert cells(browser, "models", "model", name)[1].startswith("ready"), cells(browser, "models", "model", name)
    # An API key: no buttons in the DOM, no logs, and the POST route refuses it.
    assert not by_css(browser, "button[data-verb]")
    assert by_css(browser, "#logs")[0].get_attribute("hidden") is not None
    cookie = session_cookie(browser)
    assert post_action(d, cookie, None, "restart", "other") == 403
    assert post_action(d, None, None, "restart", "other") == 403
    assert http(d, "GET", "/ui/stream?log=gateway:0", headers={"Cookie": cookie, **SAME_ORIGIN},
                key=None).status == 403


def test_an_admin_session_has_buttons_that_work(d, browser):
    sign_in(browser, d, ADMIN_KEY)
    wait_for(lambda: by_css(browser, "tr[data-model='other'] button[data-verb='unload']"), 20, what="buttons")
    cookie = session_cookie(browser)
    assert [c for c in browser.get_cookies() if c["name"].startswith("servectl_session")][0]["httpOnly"] is True
    csrf = hello(d, cookie)["csrf"]
    assert post_action(d, cookie, None, "freeze", "other") == 403  # no CSRF token
    assert post_action(d, cookie, "0" * 32, "freeze", "other") == 403  # a wrong one
    assert post_action(d, cookie, csrf, "freeze", "other") == 200  # the real one
    # The page's own button: unload `other`, then load it again.
    click(browser, "tr[data-model='other'] button[data-verb='unload']")
    wait_for(lambda: (cells(browser, "models", "model", "other") or ["", ""])[1] == "unloaded", 60,
             what="other unloaded on the page")
    click(browser, "tr[data-model='other'] button[data-verb='load']")
    wait_for(lambda: (cells(browser, "models", "model", "other") or ["", ""])[1].startswith("ready"), 180,
             what="other loaded again on the page")
    assert {m.name: str(m.state) for m in d.status().models}["other"] == "ready"


def test_the_cli_and_a_crash_show_on_the_open_page(d, browser):
    sign_in(browser, d, ADMIN_KEY)
    assert d.cli("unload", "other").returncode == 0
    wait_for(lambda: (cells(browser, "models", "model", "other") or ["", ""])[1] == "unloaded", 60,
             what="the CLI's unload on the open page")
    assert "model:other" in by_css(browser, "#events")[0].text
    worker = d.child("worker:default:0")
    os.kill(worker.pid, signal.SIGKILL)

    def restarted() -> bool:
        c = cells(browser, "processes", "component", "worker:default:0")
        return bool(c) and c[2] not in (str(worker.pid), "-") and c[5] == str(worker.restarts + 1)
    wait_for(restarted, 120, what="the worker's restart and new pid on the page",
             diagnose=lambda: str(cells(browser, "processes", "component", "worker:default:0")))
    assert str(d.child("worker:default:0").pid) == cells(browser, "processes", "component", "worker:default:0")[2]
    assert d.cli("load", "other").returncode == 0


def test_a_log_line_with_html_in_it_is_text(d, browser):
    from selenium.webdriver.support.ui import Select

    sign_in(browser, d, ADMIN_KEY)
    marker = f"<script>window.pwned={int(time.time())}</script><img/src=x>"  # no space: the log escapes it
    assert http(d, "GET", "/v1/models/" + urllib.request.quote(marker), key=API_KEY).status == 404
    wait_for(lambda: marker in d.log("gateway:0"), 20, what="the request in the gateway's log")
    Select(by_css(browser, "#log-component")[0]).select_by_value("gateway:0")
    wait_for(lambda: marker in by_css(browser, "#log-lines")[0].text, 20, what="the line on the page as text")
    assert not by_css(browser, "#log-lines *")  # text nodes only: no element was made of it
    assert browser.execute_script("return window.pwned === undefined")
    assert len(by_css(browser, "script")) == 1  # the page's own, nothing injected


def access_lines(d, since: int) -> list[str]:
    return [line for line in d.log("gateway:0").splitlines()[since:] if " GET " in line or " POST " in line]


def test_an_open_page_only_streams_and_a_closed_one_costs_nothing(d, browser):
    sign_in(browser, d, API_KEY)
    time.sleep(2.0)  # its page and assets loaded, its stream open
    start = len(d.log("gateway:0").splitlines())
    time.sleep(30.0)  # the measurement itself: what an open page asks for on an idle daemon
    during = access_lines(d, start)
    assert during == [], f"requests while the page was open: {during}"
    browser.get("about:blank")  # the page closes: its stream ends
    wait_for(lambda: any("/ui/stream" in line for line in access_lines(d, start)), 20, what="the stream's end")
    assert [re.search(r"(GET|POST) (\S+)", line).group(2) for line in access_lines(d, start)] == ["/ui/stream"]
    # Nothing samples for a closed page: the gateway and the engines (asked for stats every
    # second while it was open) sleep. The workers are frozen (freeze_grace_s = 1).
    pids = [d.manager_pid] + [c.pid for c in d.status().children if c.kind in ("gateway", "engine_core")]
    time.sleep(1.0)
    before = context_switches(pids)
    time.sleep(5.0)  # the measurement: the tree after the page closed
    woke = context_switches(pids) - before
    assert woke <= 3, f"{woke} context switches in 5 s after the page closed"
