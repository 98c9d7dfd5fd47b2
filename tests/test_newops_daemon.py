"""The daemon's routes for a command's stdin, mkdir, rename and watching, as
raw HTTP sees them (the SDK's side runs in the conformance suite): their
statuses, bodies, the watch's NDJSON stream, and what a ref may do."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import hutch
from tests.daemon_fixture import DaemonProcess


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    try:
        yield d
    finally:
        d.remove_everything()
        d.close()


@pytest.fixture
def sandbox(daemon: DaemonProcess) -> Iterator[Any]:
    workdir = tempfile.mkdtemp(prefix="hutch-newops-")
    with hutch.Client(daemon.url, token=daemon.token) as client:
        sb = client.create_sandbox("local", workdir=workdir, read_before_write=False)
        try:
            yield sb
        finally:
            sb.close()
            shutil.rmtree(workdir, ignore_errors=True)


def _http(daemon: DaemonProcess, token: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=daemon.url, timeout=60,
                        headers={"Authorization": f"Bearer {token or daemon.token}"})


def test_stdin_routes_take_raw_bytes_and_say_stdin_closed(
    daemon: DaemonProcess, sandbox: Any
) -> None:
    base = f"/v1/sandboxes/{sandbox.id}/processes"
    with _http(daemon) as http:
        started = http.post(base, json={"cmd": ["cat"], "keep_stdin": True})
        assert started.status_code == 201 and started.json()["stdin_open"] is True
        pid = started.json()["id"]
        assert http.post(f"{base}/{pid}/stdin", content=b"\x00raw\xff").status_code == 204
        assert http.delete(f"{base}/{pid}/stdin").status_code == 204
        waited = http.post(f"{base}/{pid}/wait", json={"timeout": 30}).json()
        assert waited["exit_code"] == 0 and waited["stdout_b64"] == "AHJhd/8="
        assert http.get(f"{base}/{pid}").json()["stdin_open"] is False
        plain = http.post(base, json={"cmd": ["sleep", "30"]}).json()
        assert plain["stdin_open"] is False
        refused = http.post(f"{base}/{plain['id']}/stdin", content=b"x")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "stdin_closed"
        http.post(f"{base}/{plain['id']}/kill")


def test_mkdir_and_rename_answer_their_statuses(daemon: DaemonProcess, sandbox: Any) -> None:
    base = f"/v1/sandboxes/{sandbox.id}"
    with _http(daemon) as http:
        assert http.post(f"{base}/mkdir", json={"path": "d/e", "parents": True}).status_code == 204
        again = http.post(f"{base}/mkdir", json={"path": "d/e"})
        assert (again.status_code, again.json()["error"]["code"]) == (409, "file_exists")
        sandbox.write_text("f", "x")
        through_file = http.post(f"{base}/mkdir", json={"path": "f/g"})
        assert (through_file.status_code, through_file.json()["error"]["code"]) == (
            400, "not_a_directory")
        moved = http.post(f"{base}/rename", json={"source": "f", "destination": "d/e/f"})
        assert moved.status_code == 204
        assert sandbox.read_text("d/e/f") == "x"
        workdir = http.post(f"{base}/rename", json={"source": ".", "destination": "x"})
        assert workdir.json()["error"]["code"] == "invalid_argument"


def test_the_watch_stream_tells_the_watch_then_its_events(
    daemon: DaemonProcess, sandbox: Any
) -> None:
    sandbox.mkdir("streamed")
    with _http(daemon) as http, http.stream(
        "GET", f"/v1/sandboxes/{sandbox.id}/watch", params={"path": "streamed"},
        timeout=httpx.Timeout(60, read=60),
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        lines = answer.iter_lines()
        first = json.loads(next(lines))
        assert first["watching"]["path"] == sandbox.path("streamed")
        assert first["watching"]["kind"] == "inotify"
        sandbox.write_text("streamed/one.txt", "1")
        created = sandbox.path("streamed/one.txt")
        for line in lines:
            event = json.loads(line)
            if event == {"type": "created", "path": created}:
                break
    # The stream's watch ended with it.
    with _http(daemon) as http:
        missing = http.get(f"/v1/sandboxes/{sandbox.id}/watch", params={"path": "nowhere"})
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "file_not_found")


def test_watchers_by_polling_and_through_a_ref(daemon: DaemonProcess, sandbox: Any) -> None:
    ref = sandbox.ref()
    base = f"/v1/sandboxes/{sandbox.id}"
    with _http(daemon, token=ref) as http:
        assert http.post(f"{base}/mkdir", json={"path": "by-ref"}).status_code == 204
        made = http.post(f"{base}/watchers", json={"path": "by-ref", "recursive": True})
        assert made.status_code == 201
        watcher = made.json()
        assert (watcher["recursive"], watcher["active"]) == (True, True)
        sandbox.write_text("by-ref/a.txt", "a")
        seen: list[dict[str, Any]] = []
        while {"type": "created", "path": sandbox.path("by-ref/a.txt")} not in seen:
            answer = http.get(f"{base}/watchers/{watcher['id']}/events", params={"wait": 30})
            assert answer.status_code == 200 and answer.json()["active"]
            assert answer.json()["events"], "no event came within the wait"
            seen += answer.json()["events"]
        too_long = http.get(f"{base}/watchers/{watcher['id']}/events", params={"wait": 61})
        assert too_long.status_code == 400
        assert http.delete(f"{base}/watchers/{watcher['id']}").status_code == 204
        gone = http.get(f"{base}/watchers/{watcher['id']}/events")
        assert gone.json()["error"]["code"] == "not_found"


def test_a_watch_is_found_again_by_its_id(daemon: DaemonProcess, sandbox: Any) -> None:
    """Another session (here a second client) picks up a watch by its id."""
    sandbox.mkdir("found")
    made = sandbox.watch("found")
    with hutch.Client(daemon.url, token=daemon.token) as other:
        again = other.get_sandbox(sandbox.id).watcher(made.id)
        assert (again.id, again.path, again.recursive) == (made.id, made.path, made.recursive)
        sandbox.write_text("found/new.txt", "x")
        events = again.events(wait=5)
        assert [(e.type, e.path.rsplit("/", 1)[-1]) for e in events][:1] == [
            ("created", "new.txt")], events
        again.close()
        with pytest.raises(hutch.NotFound):
            other.get_sandbox(sandbox.id).watcher(made.id)
