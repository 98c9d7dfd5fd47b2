"""The in-sandbox API of the E2B wire (envd), byte by byte: the Connect
protocol's JSON codec on its own, then every RPC and route through HTTP
against ``hutch serve`` on docker, spoken as the e2b SDKs speak it (the real
SDKs' own run is tests/test_e2b_sdk.py)."""

from __future__ import annotations

import base64
import gzip
import json
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hutch.server.e2b.envd.connect import (
    END_STREAM,
    ConnectError,
    EnvelopeReader,
    connect_error,
    end_stream,
    envelope,
    member,
    timestamp,
    unb64,
)

from .conftest import TEST_IMAGE
from .daemon_fixture import DaemonProcess

STREAM = "application/connect+json"

# -- the codec, at the byte level -------------------------------------------------------------


def test_an_envelope_is_a_flag_byte_a_big_endian_length_and_compact_json() -> None:
    assert envelope({"event": {"start": {"pid": 7}}}) == (
        b"\x00\x00\x00\x00\x1d" + b'{"event":{"start":{"pid":7}}}'
    )
    assert envelope({"s": "\u00e9"}) == b"\x00\x00\x00\x00\x0a" + '{"s":"\u00e9"}'.encode()


def test_the_end_of_a_stream_is_flagged_0x02_and_carries_its_error() -> None:
    assert end_stream() == b"\x02\x00\x00\x00\x02{}"
    body = b'{"error":{"code":"deadline_exceeded","message":"late"}}'
    assert end_stream(ConnectError("deadline_exceeded", "late")) == (
        bytes([END_STREAM]) + struct.pack(">I", len(body)) + body
    )


def test_envelopes_are_read_whatever_pieces_the_body_comes_in() -> None:
    wire = envelope({"a": 1}) + envelope({"b": [2]}) + end_stream()
    for cut in range(len(wire) + 1):
        reader = EnvelopeReader()
        got = [*reader.feed(wire[:cut]), *reader.feed(wire[cut:])]
        reader.finish()
        assert got == [(0, b'{"a":1}'), (0, b'{"b":[2]}'), (2, b"{}")]
    one_at_a_time = EnvelopeReader()
    assert [e for byte in wire for e in one_at_a_time.feed(bytes([byte]))] == got


def test_a_bad_envelope_is_a_clear_error() -> None:
    with pytest.raises(ConnectError) as big:
        list(EnvelopeReader(max_bytes=10).feed(b"\x00\x00\x00\x00\x0b" + b"x" * 11))
    assert big.value.code == "resource_exhausted"
    with pytest.raises(ConnectError) as packed:
        list(EnvelopeReader().feed(b"\x01\x00\x00\x00\x02{}"))
    assert packed.value.code == "internal"
    cut = EnvelopeReader()
    assert list(cut.feed(b"\x00\x00\x00\x00\x05{}")) == []
    with pytest.raises(ConnectError) as short:
        cut.finish()
    assert short.value.code == "invalid_argument"


def test_proto3_json_rules() -> None:
    assert timestamp(0) == "1970-01-01T00:00:00Z"
    assert timestamp(1.5) == "1970-01-01T00:00:01.500Z"
    assert timestamp(1.000001) == "1970-01-01T00:00:01.000001Z"
    assert timestamp(1.000000001) == "1970-01-01T00:00:01.000000001Z"
    for text in ("aGk/Pw==", "aGk/Pw", "aGk_Pw"):
        assert unb64(text, "f") == b"hi??"
    with pytest.raises(ConnectError):
        unb64("*", "f")
    assert member({"includeEntry": True}, "includeEntry") is True
    assert member({"include_entry": True}, "includeEntry") is True


def test_hutch_errors_become_the_codes_the_sdks_map() -> None:
    from hutch._errors import (
        ExecTimeout,
        InvalidArgument,
        NotFound,
        SandboxFileNotFound,
        SandboxUnavailable,
    )

    assert connect_error(SandboxFileNotFound("x")).wire() == {"code": "not_found", "message": "x"}
    assert connect_error(NotFound("x")).http_status == 404
    assert connect_error(InvalidArgument("x")).http_status == 400
    assert connect_error(ExecTimeout("x")).code == "deadline_exceeded"
    assert connect_error(SandboxUnavailable("x")).code == "unavailable"
    assert connect_error(RuntimeError("boom")).code == "internal"


# -- through HTTP against hutch serve on docker ------------------------------------------------


class Envd:
    """One sandbox's envd, spoken to as the SDKs do."""

    def __init__(self, url: str, sandbox_id: str, token: str) -> None:
        self.sandbox_id = sandbox_id
        self.http = httpx.Client(base_url=url, timeout=60, headers={
            "E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983",
            "X-Access-Token": token, "Connect-Protocol-Version": "1",
        })

    def unary(self, method: str, message: dict[str, Any], **headers: str) -> httpx.Response:
        return self.http.post(f"/{method}", content=json.dumps(message),
                              headers={"Content-Type": "application/json", **headers})

    def ok(self, method: str, message: dict[str, Any]) -> dict[str, Any]:
        answer = self.unary(method, message)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == "application/json"
        result: dict[str, Any] = answer.json()
        return result

    def stream(self, method: str, message: dict[str, Any], **headers: str) -> list[Any]:
        """A server stream read to its end: its messages, then the end's body."""
        body = json.dumps(message).encode()
        answer = self.http.post(
            f"/{method}", content=struct.pack(">BI", 0, len(body)) + body,
            headers={"Content-Type": STREAM, **headers},
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == STREAM
        return frames(answer.content)

    def run(self, script: str, **headers: str) -> list[Any]:
        return self.stream("process.Process/Start", {"process": {
            "cmd": "/bin/bash", "args": ["-l", "-c", script]}}, **headers)


def frames(body: bytes) -> list[Any]:
    """A stream's envelopes: each message, and last ``("end", body)``; the
    end must be the last envelope and nothing may follow it."""
    out: list[Any] = []
    at = 0
    while at < len(body):
        flags, length = struct.unpack_from(">BI", body, at)
        payload = json.loads(body[at + 5:at + 5 + length])
        at += 5 + length
        if flags == END_STREAM:
            assert at == len(body), "bytes after the end of the stream"
            out.append(("end", payload))
            return out
        assert flags == 0
        out.append(payload)
    raise AssertionError(f"the stream has no end: {out}")


def read_frames(lines: Iterator[bytes]) -> Iterator[tuple[int, Any]]:
    """Envelopes as they come off a live response."""
    buffer = b""
    for piece in lines:
        buffer += piece
        while len(buffer) >= 5:
            flags, length = struct.unpack_from(">BI", buffer)
            if len(buffer) < 5 + length:
                break
            yield flags, json.loads(buffer[5:5 + length])
            buffer = buffer[5 + length:]


def output(events: list[Any], stream: str) -> bytes:
    return b"".join(base64.b64decode(e["event"]["data"][stream]) for e in events
                    if isinstance(e, dict) and stream in e["event"].get("data", {}))


@pytest.fixture(scope="module")
def served() -> Iterator[DaemonProcess]:
    daemon = DaemonProcess(provider="docker").start()
    try:
        yield daemon
    finally:
        daemon.close()


def new_sandbox(daemon: DaemonProcess) -> Envd:
    made = httpx.post(f"{daemon.url}/v2/sandboxes", headers={"X-API-KEY": daemon.token},
                      json={"templateID": TEST_IMAGE}, timeout=120)
    assert made.status_code == 201, made.text
    return Envd(daemon.url, made.json()["sandboxID"], made.json()["envdAccessToken"])


@pytest.fixture(scope="module", params=["agent", "native"])
def watched(request: pytest.FixtureRequest, served: DaemonProcess) -> Iterator[Envd]:
    """A sandbox for the watch cases on each of docker's runtimes: the
    agent's (hutch's own watch, by inotify) and docker's own exec (envd's
    looks), opened with a ref as its access token."""
    api = httpx.Client(base_url=served.url, timeout=120,
                       headers={"Authorization": f"Bearer {served.token}"})
    made = api.post("/v1/sandboxes", json={"provider": "docker", "image": TEST_IMAGE,
                                           "runtime": request.param})
    assert made.status_code == 201, made.text
    sandbox_id = made.json()["id"]
    assert made.json()["capabilities"]["watch"] == (
        "inotify" if request.param == "agent" else "poll")
    ref = api.post(f"/v1/sandboxes/{sandbox_id}/refs", json={}).json()["ref"]
    yield Envd(served.url, sandbox_id, ref)
    api.delete(f"/v1/sandboxes/{sandbox_id}")
    api.close()


@pytest.fixture(scope="module")
def envd(served: DaemonProcess) -> Iterator[Envd]:
    sandbox = new_sandbox(served)
    yield sandbox
    httpx.delete(f"{served.url}/sandboxes/{sandbox.sandbox_id}",
                 headers={"X-API-KEY": served.token}, timeout=60)


@pytest.mark.docker
def test_start_streams_start_output_and_end_as_exact_envelopes(envd: Envd) -> None:
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": [
        "-l", "-c", "printf 'hi\\n'; printf '\\377\\000' >&2; exit 3"]}}).encode()
    answer = envd.http.post("/process.Process/Start",
                            content=struct.pack(">BI", 0, len(body)) + body,
                            headers={"Content-Type": STREAM})
    assert answer.headers["content-type"] == "application/connect+json"
    events = frames(answer.content)
    pid = events[0]["event"]["start"]["pid"]
    start = json.dumps({"event": {"start": {"pid": pid}}}, separators=(",", ":")).encode()
    assert answer.content.startswith(struct.pack(">BI", 0, len(start)) + start)
    assert output(events, "stdout") == b"hi\n"
    assert output(events, "stderr") == b"\xff\x00"
    assert events[-2] == {"event": {"end": {
        "exited": True, "status": "exit status 3", "exitCode": 3, "error": "exit status 3"}}}
    assert events[-1] == ("end", {})


@pytest.mark.docker
def test_a_command_that_ends_well_has_no_exit_code_field(envd: Envd) -> None:
    events = envd.run("true")
    assert events[-2] == {"event": {"end": {"exited": True, "status": "exit status 0"}}}


@pytest.mark.docker
def test_the_deadline_kills_the_whole_tree_and_ends_with_deadline_exceeded(envd: Envd) -> None:
    events = envd.run("sleep 300 & echo $! > /tmp/child; wait",
                      **{"Connect-Timeout-Ms": "1500"})
    assert events[-1][1]["error"]["code"] == "deadline_exceeded"
    assert not any("end" in e["event"] for e in events[:-1])
    check = envd.run('kill -0 "$(cat /tmp/child)" 2>/dev/null && echo alive || echo gone')
    assert output(check, "stdout") == b"gone\n"


@pytest.mark.docker
def test_a_quiet_command_gets_keepalives_when_asked(envd: Envd) -> None:
    events = envd.run("sleep 2.5; echo done", **{"Keepalive-Ping-Interval": "1"})
    assert {"event": {"keepalive": {}}} in events
    assert output(events, "stdout") == b"done\n"


@pytest.mark.docker
def test_background_commands_are_listed_connected_to_and_killed(envd: Envd) -> None:
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": [
        "-l", "-c", "echo first; sleep 0.5; echo second; sleep 300"]}, "tag": "job"}).encode()
    with envd.http.stream("POST", "/process.Process/Start",
                          content=struct.pack(">BI", 0, len(body)) + body,
                          headers={"Content-Type": STREAM}) as started:
        live = read_frames(started.iter_bytes())
        pid = next(live)[1]["event"]["start"]["pid"]
        first = base64.b64encode(b"first\n").decode()
        assert next(live)[1] == {"event": {"data": {"stdout": first}}}
    # the stream is gone; the command runs on
    listed = envd.ok("process.Process/List", {})["processes"]
    mine = [p for p in listed if p["pid"] == pid]
    assert mine == [{"config": {"cmd": "/bin/bash", "args": [
        "-l", "-c", "echo first; sleep 0.5; echo second; sleep 300"], "envs": {}},
        "pid": pid, "tag": "job"}]
    body = json.dumps({"process": {"tag": "job"}}).encode()
    with envd.http.stream("POST", "/process.Process/Connect",
                          content=struct.pack(">BI", 0, len(body)) + body,
                          headers={"Content-Type": STREAM}) as connected:
        live = read_frames(connected.iter_bytes())
        assert next(live)[1] == {"event": {"start": {"pid": pid}}}
        assert envd.ok("process.Process/SendSignal",
                       {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}) == {}
        rest = list(live)
    assert "end" in rest[-2][1]["event"]
    assert rest[-1] == (END_STREAM, {})
    gone = envd.unary("process.Process/SendSignal",
                      {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
    assert gone.status_code == 404
    assert gone.json()["code"] == "not_found"
    assert pid not in [p["pid"] for p in envd.ok("process.Process/List", {})["processes"]]


@pytest.mark.docker
def test_a_terminal_takes_input_and_a_new_size(envd: Envd) -> None:
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-i", "-l"],
                                   "envs": {"TERM": "xterm-256color"}},
                       "pty": {"size": {"cols": 80, "rows": 24}}}).encode()
    with envd.http.stream("POST", "/process.Process/Start",
                          content=struct.pack(">BI", 0, len(body)) + body,
                          headers={"Content-Type": STREAM}) as started:
        live = read_frames(started.iter_bytes())
        pid = next(live)[1]["event"]["start"]["pid"]
        assert envd.ok("process.Process/Update", {"process": {"pid": pid},
                                                  "pty": {"size": {"cols": 100, "rows": 30}}}) == {}
        typed = base64.b64encode(b"stty size; exit 7\n").decode()
        assert envd.ok("process.Process/SendInput",
                       {"process": {"pid": pid}, "input": {"pty": typed}}) == {}
        rest = [m for _, m in live]
    seen = b"".join(base64.b64decode(m["event"]["data"]["pty"]) for m in rest
                    if "data" in m.get("event", {}))
    assert b"30 100" in seen
    assert rest[-2]["event"]["end"]["exitCode"] == 7


@pytest.mark.docker
def test_input_streamed_to_a_terminal(envd: Envd) -> None:
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-i", "-l"]},
                       "pty": {"size": {"cols": 80, "rows": 24}}}).encode()
    with envd.http.stream("POST", "/process.Process/Start",
                          content=struct.pack(">BI", 0, len(body)) + body,
                          headers={"Content-Type": STREAM}) as started:
        live = read_frames(started.iter_bytes())
        pid = next(live)[1]["event"]["start"]["pid"]

        def requests() -> Iterator[bytes]:
            typed = [base64.b64encode(b"echo stre").decode(),
                     base64.b64encode(b"amed; exit\n").decode()]
            for message in ({"start": {"process": {"pid": pid}}},
                            {"data": {"input": {"pty": typed[0]}}},
                            {"keepalive": {}},
                            {"data": {"input": {"pty": typed[1]}}}):
                data = json.dumps(message).encode()
                yield struct.pack(">BI", 0, len(data)) + data

        answer = envd.http.post("/process.Process/StreamInput", content=requests(),
                                headers={"Content-Type": STREAM})
        assert answer.headers["content-type"] == STREAM
        assert frames(answer.content) == [{}, ("end", {})]
        rest = [m for _, m in live]
    seen = b"".join(base64.b64decode(m["event"]["data"]["pty"]) for m in rest
                    if "data" in m.get("event", {}))
    assert b"streamed" in seen


@pytest.mark.docker
def test_unary_errors_are_json_with_the_status_of_their_code(envd: Envd) -> None:
    missing = envd.unary("filesystem.Filesystem/Stat", {"path": "/no/such"})
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/json"
    assert missing.json() == {"code": "not_found", "message": "path /no/such does not exist"}
    bad = envd.unary("filesystem.Filesystem/Stat", {})
    assert (bad.status_code, bad.json()["code"]) == (400, "invalid_argument")
    unknown = envd.unary("process.Process/Nope", {})
    assert unknown.status_code == 404
    wrong_type = envd.http.post("/process.Process/List", content=b"\x08\x01",
                                headers={"Content-Type": "application/proto"})
    assert wrong_type.status_code == 415
    stream_as_unary = envd.unary("process.Process/Start", {})
    assert stream_as_unary.status_code == 400


@pytest.mark.docker
def test_filesystem_rpcs(envd: Envd) -> None:
    made = envd.ok("filesystem.Filesystem/MakeDir", {"path": "/tmp/fs/sub"})["entry"]
    assert (made["type"], made["path"], made["mode"], made["permissions"]) == (
        "FILE_TYPE_DIRECTORY", "/tmp/fs/sub", 0o755, "drwxr-xr-x")
    again = envd.unary("filesystem.Filesystem/MakeDir", {"path": "/tmp/fs/sub"})
    assert (again.status_code, again.json()["code"]) == (409, "already_exists")
    envd.run("printf 12345 > /tmp/fs/sub/a.txt; chmod 640 /tmp/fs/sub/a.txt")
    stat = envd.ok("filesystem.Filesystem/Stat", {"path": "/tmp/fs/sub/a.txt"})["entry"]
    assert stat["size"] == "5"  # int64: a string
    assert (stat["name"], stat["mode"], stat["permissions"]) == ("a.txt", 0o640, "-rw-r-----")
    assert stat["modifiedTime"].endswith("Z")
    moved = envd.ok("filesystem.Filesystem/Move",
                    {"source": "/tmp/fs/sub/a.txt", "destination": "/tmp/fs/b.txt"})["entry"]
    assert moved["path"] == "/tmp/fs/b.txt"
    shallow = envd.ok("filesystem.Filesystem/ListDir", {"path": "/tmp/fs", "depth": 1})
    assert [e["path"] for e in shallow["entries"]] == ["/tmp/fs/b.txt", "/tmp/fs/sub"]
    envd.run("touch /tmp/fs/sub/deep")
    deep = envd.ok("filesystem.Filesystem/ListDir", {"path": "/tmp/fs", "depth": 2})
    assert sorted(e["path"] for e in deep["entries"]) == [
        "/tmp/fs/b.txt", "/tmp/fs/sub", "/tmp/fs/sub/deep"]
    not_dir = envd.unary("filesystem.Filesystem/ListDir", {"path": "/tmp/fs/b.txt"})
    assert not_dir.status_code == 400
    assert envd.ok("filesystem.Filesystem/Remove", {"path": "/tmp/fs"}) == {}
    assert envd.ok("filesystem.Filesystem/Remove", {"path": "/tmp/fs"}) == {}
    assert envd.unary("filesystem.Filesystem/Stat", {"path": "/tmp/fs"}).status_code == 404


@pytest.mark.docker
def test_files_up_and_down(envd: Envd) -> None:
    several = envd.http.post("/files", files=[
        ("file", ("/tmp/up/one.txt", b"one")), ("file", ("/tmp/up/two.bin", b"\x00\xff"))])
    assert several.status_code == 200, several.text
    assert several.json() == [{"name": "one.txt", "type": "file", "path": "/tmp/up/one.txt"},
                              {"name": "two.bin", "type": "file", "path": "/tmp/up/two.bin"}]
    single = envd.http.post("/files", params={"path": "/tmp/up/named"},
                            files={"file": ("ignored", b"named")})
    assert single.json() == [{"name": "named", "type": "file", "path": "/tmp/up/named"}]
    packed = envd.http.post("/files", params={"path": "/tmp/up/z"},
                            content=gzip.compress(b"z" * 100_000),
                            headers={"Content-Type": "application/octet-stream",
                                     "Content-Encoding": "gzip"})
    assert packed.json() == [{"name": "z", "type": "file", "path": "/tmp/up/z"}]
    plain = envd.http.post("/files", params={"path": "/tmp/up/raw"}, content=b"raw bytes",
                           headers={"Content-Type": "application/octet-stream"})
    assert plain.status_code == 200
    assert envd.http.get("/files", params={"path": "/tmp/up/two.bin"}).content == b"\x00\xff"
    assert envd.http.get("/files", params={"path": "/tmp/up/named"}).content == b"named"
    assert envd.http.get("/files", params={"path": "/tmp/up/raw"}).content == b"raw bytes"
    with envd.http.stream("GET", "/files", params={"path": "/tmp/up/z"},
                          headers={"Accept-Encoding": "gzip"}) as zipped:
        assert zipped.headers["content-encoding"] == "gzip"
        assert gzip.decompress(b"".join(zipped.iter_raw())) == b"z" * 100_000
    missing = envd.http.get("/files", params={"path": "/tmp/up/none"})
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/json"
    assert missing.json()["code"] == 404
    directory = envd.http.get("/files", params={"path": "/tmp/up"})
    assert directory.status_code == 400


@pytest.mark.docker
def test_health_answers_502_once_the_sandbox_is_gone(served: DaemonProcess) -> None:
    sandbox = new_sandbox(served)
    assert sandbox.http.get("/health").status_code == 204
    killed = httpx.delete(f"{served.url}/sandboxes/{sandbox.sandbox_id}",
                          headers={"X-API-KEY": served.token}, timeout=60)
    assert killed.status_code == 204
    gone = sandbox.http.get("/health")
    assert gone.status_code == 502
    assert "was not found" in gone.json()["message"]
    assert sandbox.unary("process.Process/List", {}).status_code == 502


@pytest.mark.docker
def test_a_watched_directory_streams_its_changes(watched: Envd) -> None:
    watched.ok("filesystem.Filesystem/MakeDir", {"path": "/tmp/watched"})
    body = json.dumps({"path": "/tmp/watched", "recursive": True}).encode()
    headers = {"Content-Type": STREAM, "Connect-Timeout-Ms": "20000"}
    with watched.http.stream("POST", "/filesystem.Filesystem/WatchDir", headers=headers,
                             content=struct.pack(">BI", 0, len(body)) + body) as answer:
        assert answer.headers["content-type"] == STREAM
        live = read_frames(answer.iter_bytes())
        assert next(live) == (0, {"start": {}})
        watched.run("mkdir /tmp/watched/sub; printf x > /tmp/watched/sub/new.txt")
        seen: list[tuple[str, str]] = []
        for _, message in live:
            if "filesystem" in message:
                seen.append((message["filesystem"]["name"], message["filesystem"]["type"]))
            if ("sub/new.txt", "EVENT_TYPE_WRITE") in seen:
                break
    assert ("sub", "EVENT_TYPE_CREATE") in seen
    assert seen.index(("sub/new.txt", "EVENT_TYPE_CREATE")) < seen.index(
        ("sub/new.txt", "EVENT_TYPE_WRITE"))


@pytest.mark.docker
def test_a_polled_watcher_hands_over_what_happened_since_the_last_poll(watched: Envd) -> None:
    watched.ok("filesystem.Filesystem/MakeDir", {"path": "/tmp/polled"})
    watched.run("printf old > /tmp/polled/gone.txt")
    missing = watched.unary("filesystem.Filesystem/CreateWatcher", {"path": "/tmp/none"})
    assert missing.status_code == 404
    watcher = watched.ok("filesystem.Filesystem/CreateWatcher",
                      {"path": "/tmp/polled", "includeEntry": True})["watcherId"]
    watched.run("rm /tmp/polled/gone.txt; printf abc > /tmp/polled/made.txt")
    events: list[dict[str, Any]] = []
    for _ in range(100):  # until the watch has looked (it looks every fraction of a second)
        events += watched.ok("filesystem.Filesystem/GetWatcherEvents",
                          {"watcherId": watcher})["events"]
        if len(events) >= 3:
            break
        watched.run("sleep 0.1")
    assert [(e["name"], e["type"]) for e in events] == [
        ("gone.txt", "EVENT_TYPE_REMOVE"), ("made.txt", "EVENT_TYPE_CREATE"),
        ("made.txt", "EVENT_TYPE_WRITE")]
    assert events[1]["entry"]["path"] == "/tmp/polled/made.txt"
    assert "entry" not in events[0]
    assert watched.ok("filesystem.Filesystem/RemoveWatcher", {"watcherId": watcher}) == {}
    after = watched.unary("filesystem.Filesystem/GetWatcherEvents", {"watcherId": watcher})
    assert (after.status_code, after.json()["code"]) == (404, "not_found")


@pytest.mark.docker
def test_what_envd_changes_is_told_to_watches_as_it_is_done(watched: Envd) -> None:
    """Made, renamed and removed between two looks: still every event, in
    order, as inotify gives them (a rename: the old name renamed, the new
    one created)."""
    watched.ok("filesystem.Filesystem/MakeDir", {"path": "/tmp/told"})
    watcher = watched.ok("filesystem.Filesystem/CreateWatcher",
                      {"path": "/tmp/told", "recursive": True})["watcherId"]
    watched.http.post("/files", files={"file": ("/tmp/told/sub/one.txt", b"1")})
    watched.ok("filesystem.Filesystem/Move",
            {"source": "/tmp/told/sub/one.txt", "destination": "/tmp/told/two.txt"})
    watched.ok("filesystem.Filesystem/Remove", {"path": "/tmp/told/two.txt"})
    watched.ok("filesystem.Filesystem/MakeDir", {"path": "/tmp/told/dir"})
    events = watched.ok("filesystem.Filesystem/GetWatcherEvents", {"watcherId": watcher})["events"]
    assert [(e["name"], e["type"]) for e in events] == [
        ("sub", "EVENT_TYPE_CREATE"), ("sub/one.txt", "EVENT_TYPE_CREATE"),
        ("sub/one.txt", "EVENT_TYPE_WRITE"), ("sub/one.txt", "EVENT_TYPE_RENAME"),
        ("two.txt", "EVENT_TYPE_CREATE"), ("two.txt", "EVENT_TYPE_REMOVE"),
        ("dir", "EVENT_TYPE_CREATE")]
    watched.ok("filesystem.Filesystem/RemoveWatcher", {"watcherId": watcher})


@pytest.mark.docker
def test_stdin_of_a_running_command_is_written_streamed_and_closed(envd: Envd) -> None:
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "cat"]},
                       "stdin": True}).encode()
    with envd.http.stream("POST", "/process.Process/Start",
                          content=struct.pack(">BI", 0, len(body)) + body,
                          headers={"Content-Type": STREAM}) as started:
        live = read_frames(started.iter_bytes())
        pid = next(live)[1]["event"]["start"]["pid"]
        first = base64.b64encode(b"one\n").decode()
        assert envd.ok("process.Process/SendInput",
                       {"process": {"pid": pid}, "input": {"stdin": first}}) == {}

        def requests() -> Iterator[bytes]:
            for message in ({"start": {"process": {"pid": pid}}},
                            {"data": {"input": {"stdin": base64.b64encode(b"two\n").decode()}}}):
                data = json.dumps(message).encode()
                yield struct.pack(">BI", 0, len(data)) + data

        streamed = envd.http.post("/process.Process/StreamInput", content=requests(),
                                  headers={"Content-Type": STREAM})
        assert frames(streamed.content) == [{}, ("end", {})]
        assert envd.ok("process.Process/CloseStdin", {"process": {"pid": pid}}) == {}
        rest = [m for _, m in live]
    assert output(rest[:-1], "stdout") == b"one\ntwo\n"
    assert rest[-2] == {"event": {"end": {"exited": True, "status": "exit status 0"}}}


@pytest.mark.docker
def test_stdin_not_asked_for_cannot_be_written(envd: Envd) -> None:
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "sleep 30"]},
                       "stdin": False}).encode()
    with envd.http.stream("POST", "/process.Process/Start",
                          content=struct.pack(">BI", 0, len(body)) + body,
                          headers={"Content-Type": STREAM}) as started:
        pid = next(read_frames(started.iter_bytes()))[1]["event"]["start"]["pid"]
        refused = envd.unary("process.Process/SendInput", {
            "process": {"pid": pid}, "input": {"stdin": base64.b64encode(b"x").decode()}})
        assert (refused.status_code, refused.json()["code"]) == (400, "failed_precondition")
        envd.ok("process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})


@pytest.mark.docker
def test_a_watch_does_not_wake_a_paused_sandbox(served: DaemonProcess) -> None:
    sandbox = new_sandbox(served)
    api = httpx.Client(base_url=served.url, headers={"X-API-KEY": served.token}, timeout=60)
    try:
        sandbox.ok("filesystem.Filesystem/MakeDir", {"path": "/tmp/asleep"})
        watcher = sandbox.ok("filesystem.Filesystem/CreateWatcher",
                             {"path": "/tmp/asleep"})["watcherId"]
        assert api.post(f"/sandboxes/{sandbox.sandbox_id}/pause", json={}).status_code == 204
        for _ in range(10):  # several of the watch's looks (one every 0.3 s)
            time.sleep(0.3)
            assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "paused"
        resumed = api.post(f"/sandboxes/{sandbox.sandbox_id}/connect", json={"timeout": 60})
        assert resumed.status_code == 201
        sandbox.run("touch /tmp/asleep/after")
        events: list[dict[str, Any]] = []
        for _ in range(100):
            events += sandbox.ok("filesystem.Filesystem/GetWatcherEvents",
                                 {"watcherId": watcher})["events"]
            if events:
                break
            time.sleep(0.1)
        assert [(e["name"], e["type"]) for e in events] == [("after", "EVENT_TYPE_CREATE")]
    finally:
        api.delete(f"/sandboxes/{sandbox.sandbox_id}")
        api.close()


@pytest.mark.docker
def test_a_stream_not_read_holds_up_neither_the_command_nor_the_others(
    served: DaemonProcess, envd: Envd,
) -> None:
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": [
        "-l", "-c", "head -c 40000000 /dev/zero | tr '\\0' x; sleep 1"]},
        "tag": "unread"}).encode()
    request = (
        f"POST /process.Process/Start HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"E2b-Sandbox-Id: {envd.sandbox_id}\r\n"
        f"X-Access-Token: {envd.http.headers['X-Access-Token']}\r\n"
        f"Content-Type: {STREAM}\r\nContent-Length: {len(body) + 5}\r\n\r\n"
    ).encode() + struct.pack(">BI", 0, len(body)) + body
    # A caller that reads nothing: its window (a small receive buffer) fills.
    with socket.socket() as caller:
        caller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        caller.connect(("127.0.0.1", served.port))
        caller.sendall(request)
        pid = None
        for _ in range(200):
            listed = envd.ok("process.Process/List", {})["processes"]
            if pid is None:
                pid = next((p["pid"] for p in listed if p.get("tag") == "unread"), None)
            if pid is not None and pid not in [p["pid"] for p in listed]:
                break
            time.sleep(0.1)
        # The command ended all the same, and was forgotten as it ended.
        assert pid is not None and pid not in [p["pid"] for p in listed]
        gone = envd.unary("process.Process/SendSignal",
                          {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
        assert gone.status_code == 404


@pytest.mark.docker
def test_entries_name_their_owner_and_a_user_s_files_are_theirs(envd: Envd) -> None:
    envd.run("id -u hutchling >/dev/null 2>&1 || useradd -m hutchling")
    as_user = {"Authorization": "Basic " + base64.b64encode(b"hutchling:").decode()}
    written = envd.http.post("/files", params={"path": "/tmp/own/deep/er/f.txt",
                                               "username": "hutchling"},
                             files={"file": ("f.txt", b"mine")})
    assert written.status_code == 200, written.text
    entries = envd.ok("filesystem.Filesystem/ListDir", {"path": "/tmp/own", "depth": 4})
    assert {(e["path"], e["owner"], e["group"]) for e in entries["entries"]} == {
        ("/tmp/own/deep", "hutchling", "hutchling"),
        ("/tmp/own/deep/er", "hutchling", "hutchling"),
        ("/tmp/own/deep/er/f.txt", "hutchling", "hutchling")}
    made = envd.unary("filesystem.Filesystem/MakeDir", {"path": "/tmp/own/d1/d2"}, **as_user)
    assert made.json()["entry"]["owner"] == "hutchling"
    assert envd.ok("filesystem.Filesystem/Stat", {"path": "/tmp/own/d1"})["entry"]["owner"] \
        == "hutchling"
    assert envd.ok("filesystem.Filesystem/Stat", {"path": "/tmp"})["entry"]["owner"] == "root"
    envd.ok("filesystem.Filesystem/Remove", {"path": "/tmp/own"})
    nobody = envd.http.post("/files", params={"path": "/tmp/nobody.txt", "username": "nosuch"},
                            files={"file": ("x", b"x")})
    assert nobody.status_code == 400


@pytest.mark.docker
def test_malformed_requests_are_invalid_arguments(envd: Envd) -> None:
    for method, message in [
        ("filesystem.Filesystem/Stat", {"path": 5}),
        ("filesystem.Filesystem/ListDir", {"path": "/", "depth": "deep"}),
        ("filesystem.Filesystem/ListDir", {"path": "/", "depth": 1e300}),
        ("process.Process/SendSignal", {"process": "1", "signal": "SIGNAL_SIGKILL"}),
        ("process.Process/SendInput", {"process": {"pid": 1000}, "input": {"stdin": "*"}}),
    ]:
        answer = envd.unary(method, message)
        assert answer.status_code in (400, 404), (method, answer.text)
        assert answer.json()["code"] in ("invalid_argument", "not_found"), answer.text
    not_json = envd.http.post("/filesystem.Filesystem/Stat", content=b"{",
                              headers={"Content-Type": "application/json"})
    assert (not_json.status_code, not_json.json()["code"]) == (400, "invalid_argument")
    for start in [{"process": {"cmd": "/bin/true", "args": "x"}},
                  {"process": {"cmd": "/bin/true", "envs": {"A": 1}}},
                  {"process": {"cmd": "/bin/true"}, "pty": {"size": {"rows": 0, "cols": 9}}},
                  {"process": {}}]:
        events = envd.stream("process.Process/Start", start)
        assert events[-1][0] == "end"
        assert events[-1][1]["error"]["code"] == "invalid_argument", events
    half = envd.http.post("/process.Process/Start", content=b"\x00\x00\x00\x00\x09{}",
                          headers={"Content-Type": STREAM})
    assert frames(half.content)[-1][1]["error"]["code"] == "invalid_argument"
