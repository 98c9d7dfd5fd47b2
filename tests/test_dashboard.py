"""The dashboard at /ui: its session (login, cookie, the header beside it)
over HTTP, and the pages themselves in a real headless browser (Debian's
chromium driven by Playwright; scripts/test.sh installs both).

Screenshots of the sandboxes page and of a sandbox's page are saved to
$HUTCH_TEST_ARTIFACTS (default /tmp/hutch-artifacts), outside the repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

import hutch
from hutch.server.uisession import COOKIE_NAME, SESSION_SECONDS, new_session
from tests.artifacts import artifacts_dir
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess, end_everything

CHROMIUM = "/usr/bin/chromium"
#: How long a page may take to show what the test waits for (a hang guard),
#: but for the one figure the issue sets: a new sandbox shows within 2 s.
HANG_GUARD_MS = 30_000
APPEARS_WITHIN_MS = 2_000


#: The daemon's sampling of memory and disk (default 10 s): often, so that a
#: sandbox has a history by the time the test opens its page.
METER_INTERVAL = 0.3


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with tempfile.TemporaryDirectory() as config_dir:
        config = os.path.join(config_dir, "hutch.toml")
        with open(config, "w") as fh:
            fh.write(f"[server]\nmeter_interval = {METER_INTERVAL}\n")
        d = DaemonProcess(extra_args=["--config", config]).start()
        try:
            yield d
        finally:
            d.close()


def _login(d: DaemonProcess) -> httpx.Cookies:
    answer = httpx.post(f"{d.url}/ui/login", json={"token": d.token})
    assert answer.status_code == 204, answer.text
    return answer.cookies


def _raw_get(d: DaemonProcess, target: bytes) -> int:
    """The status of a GET of ``target`` as sent, with no client tidying its dots."""
    with socket.create_connection(("127.0.0.1", d.port), timeout=30) as sock:
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = sock.recv(64)
    return int(head.split(b" ")[1])


# -- the session, over HTTP ------------------------------------------------------------------


def test_pages_are_open_and_say_where_scripts_come_from(daemon: DaemonProcess) -> None:
    page = httpx.get(f"{daemon.url}/ui/")
    assert page.status_code == 200 and "<script type=\"module\"" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    script = httpx.get(f"{daemon.url}/ui/static/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "frame-ancestors 'none'" in script.headers["content-security-policy"]
    assert httpx.get(f"{daemon.url}/ui/static/nothing.js").status_code == 404


def test_login_takes_the_token_and_sets_a_strict_httponly_cookie(daemon: DaemonProcess) -> None:
    answer = httpx.post(f"{daemon.url}/ui/login", json={"token": daemon.token})
    assert answer.status_code == 204
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE_NAME}=")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    assert daemon.token not in cookie  # the cookie holds a signature, not the token


@pytest.mark.parametrize("body", [{"token": "wrong"}, {"token": ""}, {}, ["x"]])
def test_login_refuses_a_wrong_or_missing_token(daemon: DaemonProcess, body: object) -> None:
    answer = httpx.post(f"{daemon.url}/ui/login", json=body)
    assert answer.status_code in (400, 401)
    assert "set-cookie" not in answer.headers
    assert answer.json()["error"]["code"] in ("unauthorized", "invalid_argument")


def test_login_takes_json_only(daemon: DaemonProcess) -> None:
    """Another site's form (text/plain, urlencoded) cannot log a browser in."""
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        answer = httpx.post(f"{daemon.url}/ui/login", headers={"content-type": content_type},
                            content=json.dumps({"token": daemon.token}))
        assert answer.status_code == 400 and "set-cookie" not in answer.headers


def test_the_session_counts_only_with_the_dashboards_header(daemon: DaemonProcess) -> None:
    cookies = _login(daemon)
    ui = {"x-hutch-ui": "1"}
    url = f"{daemon.url}/v1/sandboxes"
    assert httpx.get(url, cookies=cookies, headers=ui).status_code == 200
    # A request another site forges (a form, a link) cannot add the header.
    assert httpx.get(url, cookies=cookies).status_code == 401
    assert httpx.get(url, headers=ui).status_code == 401
    forged = {COOKIE_NAME: f"{int(time.time()) + 3600}.{'0' * 64}"}
    assert httpx.get(url, cookies=forged, headers=ui).status_code == 401
    ended = {COOKIE_NAME: new_session(daemon.token.encode(), time.time() - SESSION_SECONDS - 1)}
    assert httpx.get(url, cookies=ended, headers=ui).status_code == 401
    other = {COOKIE_NAME: new_session(b"another daemon's token")}
    assert httpx.get(url, cookies=other, headers=ui).status_code == 401


def test_every_route_refuses_half_a_session(daemon: DaemonProcess) -> None:
    """On every route of the API: the cookie without the header, the header
    without the cookie, or a forged cookie with it is no credential."""
    session = f"{COOKIE_NAME}={_login(daemon)[COOKIE_NAME]}"
    forged = f"{COOKIE_NAME}={int(time.time()) + 3600}.{'0' * 64}"
    schema = httpx.get(f"{daemon.url}/openapi.json",
                       headers={"Authorization": f"Bearer {daemon.token}"}).json()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    assert len(routes) > 25
    with httpx.Client(base_url=daemon.url, timeout=60) as http:
        for method, path in [*routes, ("GET", "/openapi.json"), ("GET", "/metrics")]:
            url = re.sub(r"\{[^}]+\}", "x", path)
            for headers in ({"cookie": session}, {"x-hutch-ui": "1"},
                            {"cookie": forged, "x-hutch-ui": "1"}):
                answer = http.request(method, url, headers=headers, json={})
                assert answer.status_code == 401, (method, path, headers, answer.status_code)


def test_the_open_pages_open_no_path_to_the_api(daemon: DaemonProcess) -> None:
    for target in (b"/ui/../v1/sandboxes", b"/ui/static/../../v1/sandboxes",
                   b"/ui/static/%2e%2e/%2e%2e/v1/sandboxes", b"/ui/..%2fv1/sandboxes"):
        assert _raw_get(daemon, target) in (401, 404), target


def test_state_changes_take_the_session_on_post_only_with_the_header(
    daemon: DaemonProcess,
) -> None:
    cookies = _login(daemon)
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sandbox = c.create_sandbox("bubblewrap", image=TEST_IMAGE)
        try:
            url = f"{daemon.url}/v1/sandboxes/{sandbox.id}/pause"
            assert httpx.post(url, cookies=cookies).status_code == 401
            assert sandbox.info()["state"] == "running"
            answer = httpx.post(url, cookies=cookies, headers={"x-hutch-ui": "1"})
            assert answer.status_code == 200 and answer.json()["state"] == "paused"
            # Reading a state is no way to change it.
            assert httpx.get(url, cookies=cookies, headers={"x-hutch-ui": "1"}).status_code == 405
        finally:
            c.delete_sandbox(sandbox.id)


def test_logout_ends_the_browsers_session(daemon: DaemonProcess) -> None:
    answer = httpx.post(f"{daemon.url}/ui/logout", headers={"x-hutch-ui": "1"})
    assert answer.status_code == 204
    assert "Max-Age=0" in answer.headers["set-cookie"]
    # Another site's form (no header) cannot end a session.
    forged = httpx.post(f"{daemon.url}/ui/logout")
    assert forged.status_code == 400 and "set-cookie" not in forged.headers


def test_a_bubblewrap_sandbox_tells_the_disk_its_files_take(daemon: DaemonProcess) -> None:
    """The Disk column's figure: running (its tmpfs), suspended (its directory)."""
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sandbox = c.create_sandbox("bubblewrap", image=TEST_IMAGE)
        try:
            before = sandbox.info()["disk_bytes"]
            assert isinstance(before, int)
            sandbox.exec("head -c 3000000 /dev/urandom > blob")
            running = sandbox.info()["disk_bytes"]
            assert running >= before + 3_000_000
            sandbox.suspend()
            suspended = sandbox.info()
            assert suspended["state"] == "suspended"
            assert suspended["disk_bytes"] >= 3_000_000
            listed = {s["id"]: s for s in c.list_sandboxes()}[sandbox.id]
            assert listed["disk_bytes"] == suspended["disk_bytes"]
            sandbox.exec("rm blob")  # resumes it
            assert sandbox.info()["disk_bytes"] < 3_000_000
        finally:
            c.delete_sandbox(sandbox.id)
        ended = c.list_sandboxes(include_ended=True)
        assert {s["id"]: s for s in ended}[sandbox.id]["disk_bytes"] is None


# -- the pages, in a browser -----------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    # Missing, a failure, not a skip: the issue wants this test in the test command.
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM) and shutil.which("chromium") is None:
        pytest.fail("chromium is not installed: scripts/test.sh installs Debian's")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
            headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


def test_a_wrong_token_is_refused_in_the_browser(daemon: DaemonProcess, browser: object) -> None:
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{daemon.url}/ui/")
        page.fill("#token", "not the token")
        page.click("#login button[type=submit]")
        expect(page.locator("#login-error")).to_have_text("Wrong token.", timeout=HANG_GUARD_MS)
        assert context.cookies() == []
        expect(page.locator("#nav")).to_be_hidden()
    finally:
        context.close()


def test_dashboard_shows_a_new_sandbox_live_and_suspends_it(
    daemon: DaemonProcess, browser: object,
) -> None:
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    artifacts = artifacts_dir()
    context = browser.new_context(viewport={"width": 1400, "height": 800})
    requests: list[str] = []
    failures: list[str] = []
    try:
        page = context.new_page()
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda error: failures.append(str(error)))
        page.goto(f"{daemon.url}/ui/")
        page.fill("#token", daemon.token)
        page.click("#login button[type=submit]")
        expect(page.locator("#sandboxes")).to_be_visible(timeout=HANG_GUARD_MS)
        expect(page.locator("#live")).to_have_class("live on", timeout=HANG_GUARD_MS)
        (cookie,) = context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # no script reads the session

        with hutch.Client(daemon.url, token=daemon.token) as c:
            sandbox = c.create_sandbox("bubblewrap", image=TEST_IMAGE)
            try:
                row = page.locator(f"#sandbox-rows tr[data-id='{sandbox.id}']")
                # The figure: the page shows it within 2 s of its creation.
                expect(row).to_be_visible(timeout=APPEARS_WITHIN_MS)
                expect(row.locator("td.col-state")).to_have_text("running")
                expect(row.locator("td.col-disk")).to_have_text(re.compile(r"\d+(\.\d)? [KMG]?i?B"))
                sandbox.exec("echo hello > note.txt")
                page.screenshot(path=os.path.join(artifacts, "dashboard-sandboxes.png"),
                                full_page=True)

                # The daemon sampled it meanwhile: its page's plots start from that.
                deadline = time.monotonic() + HANG_GUARD_MS / 1000
                while len(c.meter_history(sandbox.id)) < 3 and time.monotonic() < deadline:
                    time.sleep(METER_INTERVAL)
                assert len(c.meter_history(sandbox.id)) >= 3
                row.locator("a").click()
                expect(page.locator("#facts")).to_contain_text("bubblewrap",
                                                               timeout=HANG_GUARD_MS)
                page.click("#tab-usage")
                for figure in ("memory", "disk"):
                    plotted = page.locator(f"#usage figure[data-plot={figure}]")
                    # At least the three samples the daemon had: the page alone has one.
                    expect(plotted).to_have_attribute(
                        "data-from-daemon", re.compile(r"^([3-9]|\d{2,})$"),
                        timeout=HANG_GUARD_MS)
                    expect(plotted.locator("path.line")).to_have_attribute(
                        "d", re.compile(r"^M[\d.]+,[\d.]+( L[\d.]+,[\d.]+){2,}"))
                page.click("#do-suspend")
                expect(page.locator("#sandbox-state [data-state]")).to_have_text(
                    "suspended", timeout=HANG_GUARD_MS)
                assert sandbox.info()["state"] == "suspended"

                page.click("#tab-events")
                events = page.locator("#events tbody")
                expect(events).to_contain_text("running -> suspended", timeout=HANG_GUARD_MS)
                page.screenshot(path=os.path.join(artifacts, "dashboard-sandbox.png"),
                                full_page=True)

                # Back in the list, its new state shows there too.
                page.click("a[data-nav=sandboxes]")
                expect(page.locator(
                    f"#sandbox-rows tr[data-id='{sandbox.id}'] td.col-state")).to_have_text(
                    "suspended", timeout=HANG_GUARD_MS)
            finally:
                c.delete_sandbox(sandbox.id)
        print(f"dashboard screenshots: {artifacts}/dashboard-sandboxes.png, "
              f"{artifacts}/dashboard-sandbox.png")
    finally:
        context.close()
    # No credential in any address the page asked for; no script failed.
    assert not [u for u in requests if daemon.token in u]
    assert failures == []


def test_a_sandboxs_page_browses_files_forks_and_kills(
    daemon: DaemonProcess, browser: object,
) -> None:
    """The page's other tools: its files (browsed, downloaded), processes, a
    fork through its dialog and the lineage that shows it, and a kill that
    asks first; and the workspaces, definitions and pools pages."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    context = browser.new_context(accept_downloads=True)
    failures: list[str] = []
    try:
        page = context.new_page()
        page.on("pageerror", lambda error: failures.append(str(error)))
        page.goto(f"{daemon.url}/ui/")
        page.fill("#token", daemon.token)
        page.click("#login button[type=submit]")
        expect(page.locator("#sandboxes")).to_be_visible(timeout=HANG_GUARD_MS)
        with hutch.Client(daemon.url, token=daemon.token) as c:
            sandbox = c.create_sandbox("bubblewrap", image=TEST_IMAGE)
            forks: list[str] = []
            try:
                sandbox.exec("mkdir -p docs && echo 'hello from the sandbox' > docs/note.txt")
                sandbox.start("sleep 300")
                page.goto(f"{daemon.url}/ui/#/sandboxes/{sandbox.id}")
                expect(page.locator("#sandbox-state [data-state]")).to_have_text(
                    "running", timeout=HANG_GUARD_MS)

                page.click("#tab-processes")
                expect(page.locator("#processes")).to_contain_text(
                    "sleep 300", timeout=HANG_GUARD_MS)

                page.click("#tab-files")
                page.locator("#files a", has_text="docs/").click()
                row = page.locator("#files tr", has_text="note.txt")
                expect(row).to_be_visible(timeout=HANG_GUARD_MS)
                with page.expect_download(timeout=HANG_GUARD_MS) as download:
                    row.locator("button", has_text="Download").click()
                saved = download.value.path()
                with open(saved) as fh:
                    assert fh.read() == "hello from the sandbox\n"
                assert download.value.suggested_filename == "note.txt"

                page.click("#do-fork")
                page.fill("#ask-input", "from the page")
                page.click("#ask-ok")
                expect(page.locator("#toast")).to_contain_text("Forked", timeout=HANG_GUARD_MS)
                forks = [s["id"] for s in c.list_sandboxes() if s["id"] != sandbox.id]
                assert len(forks) == 1
                page.click("#tab-lineage")
                tree = page.locator("#lineage")
                expect(tree.locator(f"[data-sandbox='{forks[0]}']")).to_be_visible(
                    timeout=HANG_GUARD_MS)
                expect(tree).to_contain_text("from the page")

                # Kill asks first: cancelled, nothing happens; confirmed, it ends.
                page.click("#do-kill")
                page.locator("#ask button[value=cancel]").click()
                assert sandbox.info()["state"] == "running"
                page.click("#do-kill")
                page.click("#ask-ok")
                expect(page.locator("#sandbox-state [data-state]")).to_have_text(
                    "terminated", timeout=HANG_GUARD_MS)
            finally:
                end_everything(c, force=True)

        with hutch.Client(daemon.url, token=daemon.token) as c:
            c.put_definition({"id": "dash-def", "provider": "local"})
            c.create_workspace("dash-ws", provider="bubblewrap", image=TEST_IMAGE)
            try:
                for name in ("workspaces", "definitions", "pools"):
                    page.click(f"a[data-nav={name}]")
                    expect(page.locator("main h1")).to_have_text(
                        name.capitalize(), timeout=HANG_GUARD_MS)
                    expect(page.locator("main .error")).to_have_count(0)
                    if name == "definitions":
                        expect(page.locator("#definitions tr[data-id=dash-def] td").nth(1)
                               ).to_have_text("local", timeout=HANG_GUARD_MS)
                    if name == "workspaces":
                        expect(page.locator("#workspaces tr[data-name=dash-ws] td").nth(1)
                               ).to_have_text("running", timeout=HANG_GUARD_MS)
            finally:
                end_everything(c, force=True)

        # A pool, resized and removed from its page.
        with hutch.Client(daemon.url, token=daemon.token) as c:
            c.set_pool("dash", 0, {"provider": "local"})
            try:
                page.reload()
                row = page.locator("#pools tr[data-name=dash]")
                expect(row).to_be_visible(timeout=HANG_GUARD_MS)
                row.locator("button", has_text="Resize").click()
                page.fill("#ask-input", "1")
                page.click("#ask-ok")
                expect(row.locator("td").nth(2)).to_have_text("1", timeout=HANG_GUARD_MS)
                assert [p["size"] for p in c.list_pools() if p["name"] == "dash"] == [1]
                row.locator("button", has_text="Remove").click()
                page.click("#ask-ok")
                expect(row).to_have_count(0, timeout=HANG_GUARD_MS)
                assert not [p for p in c.list_pools() if p["name"] == "dash"]
            finally:
                if [p for p in c.list_pools() if p["name"] == "dash"]:
                    c.remove_pool("dash")

        page.click("#logout")
        expect(page.locator("#login")).to_be_visible(timeout=HANG_GUARD_MS)
        assert context.cookies() == []
    finally:
        context.close()
    assert failures == []
