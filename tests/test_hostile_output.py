"""Callers cannot take the daemon's memory, whatever they print or send.

A real daemon, callers at once through the wire: large outputs (text, JSON-
hostile NULs, bytes that are not UTF-8), one over its ``output_limit``, a
background command's wait, a stream read slowly, an exec whose input is over
the daemon's memory budget (told ahead or chunked), background commands that
never read their stdin, and a grep matching millions of empty lines. Every
caller gets its output intact (by hash) or its typed error; the daemon's
peak resident memory grows by a bounded amount, whatever the output's size,
and it serves others after.
The sizes here are small so that it runs in seconds; bench/bench_memory.py
drives 20 callers of 250 MB each.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests import isolating
from tests.daemon_fixture import DaemonProcess
from tests.isolating import kube_standin  # noqa: F401  (a fixture)
from tests.kube_standin import KubeStandin

pytestmark = pytest.mark.docker  # both providers run the test image

#: Bytes each caller's command prints: large beside what the daemon may
#: hold for it, small enough for the test to run in seconds.
SIZE = 24 << 20
#: What the daemon's resident memory may grow by while they all run.
GROWTH_CAP = 64 << 20
#: The budget of the daemon that refuses input: under one caller's stdin.
SMALL_BUDGET = 4 << 20

#: The kinds whose outputs come through a path of their own: the native
#: runtimes (a subprocess's pipes, docker exec's stream, pods/exec's
#: WebSocket) and the agent's (bubblewrap's; gvisor's through gVisor's gofer).
PROVIDERS = isolating.params("bubblewrap-native", "docker-native", "bubblewrap-agent",
                             "gvisor", "kubernetes")


def _config(tmp: str, budget: int | None) -> list[str]:
    if budget is None:
        return []
    path = os.path.join(tmp, "hutch.toml")
    with open(path, "w") as fh:
        fh.write(f"[server]\nmemory_budget = {budget}\n")
    return ["--config", path]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(token=f"tok-{uuid.uuid4().hex}",
                      extra_args=isolating.DAEMON_ALLOWS).start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def small_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    args = _config(str(tmp_path_factory.mktemp("budget")), SMALL_BUDGET)
    d = DaemonProcess(token=f"tok-{uuid.uuid4().hex}", extra_args=args).start()
    yield d
    d.close()


def _headers(d: DaemonProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {d.token}"}


def _sandbox(d: DaemonProcess, kind: str, request: pytest.FixtureRequest | None = None) -> str:
    standin: KubeStandin | None = (
        request.getfixturevalue("kube_standin") if request and kind == "kubernetes" else None)
    settings = isolating.settings(kind, standin)
    answer = httpx.post(f"{d.url}/v1/sandboxes", json=settings, headers=_headers(d),
                        timeout=300)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def _delete(d: DaemonProcess, sandbox_id: str) -> None:
    httpx.delete(f"{d.url}/v1/sandboxes/{sandbox_id}", headers=_headers(d), timeout=120)


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _peak_growth(d: DaemonProcess, burst: Callable[[], None]) -> int:
    """How far the daemon's resident memory rose above where it was while
    ``burst`` ran (the kernel's high-water mark, reset first)."""
    assert d.proc is not None
    pid = d.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current resident size
    before = _status(pid, "VmRSS")
    burst()
    return _status(pid, "VmHWM") - before


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _repeated(text: bytes, size: int) -> bytes:
    return (text * (size // len(text) + 1))[:size]


def _answered_output(answer: httpx.Response, stream: str = "stdout") -> bytes:
    """An exec answer's output, whichever way it travelled."""
    assert answer.status_code == 200, answer.text[:500]
    body = answer.json()
    if f"{stream}_b64" in body:
        return base64.b64decode(body[f"{stream}_b64"])
    return str(body[stream]).encode()


class Callers:
    """Callers run at once, each in its thread; what went wrong, by name."""

    def __init__(self) -> None:
        self.failures: dict[str, str] = {}
        self.answered: set[str] = set()
        self._threads: list[threading.Thread] = []

    def add(self, name: str, call: Callable[[], None]) -> None:
        def run() -> None:
            try:
                call()
                self.answered.add(name)
            except BaseException as exc:  # reported by name below
                self.failures[name] = f"{type(exc).__name__}: {exc}"[:1000]

        self._threads.append(threading.Thread(target=run, name=name))

    def run(self) -> None:
        for thread in self._threads:
            thread.start()
        for thread in self._threads:
            thread.join(600)


def _exec(d: DaemonProcess, sandbox_id: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{d.url}/v1/sandboxes/{sandbox_id}/exec", json=body,
                      headers=_headers(d), timeout=300)


def _printing(d: DaemonProcess, sandbox_id: str, cmd: str, expected: bytes,
              stream: str = "stdout") -> Callable[[], None]:
    def call() -> None:
        got = _answered_output(_exec(d, sandbox_id, {"cmd": cmd, "output_limit": SIZE * 2}),
                               stream)
        assert len(got) == len(expected), (len(got), len(expected))
        assert _digest(got) == _digest(expected)

    return call


def _over_its_limit(d: DaemonProcess, sandbox_id: str) -> None:
    answer = _exec(d, sandbox_id, {"cmd": f"head -c {SIZE} /dev/zero",
                                   "output_limit": SIZE // 2})
    assert answer.status_code == 413, answer.text[:500]
    assert answer.json()["error"]["code"] == "output_limit_exceeded"


def _background_wait(d: DaemonProcess, sandbox_id: str, expected: bytes) -> None:
    base = f"{d.url}/v1/sandboxes/{sandbox_id}/processes"
    started = httpx.post(base, json={"cmd": f"yes background | head -c {SIZE}",
                                     "output_limit": SIZE * 2},
                         headers=_headers(d), timeout=120)
    assert started.status_code == 201, started.text
    pid = started.json()["id"]
    answer = httpx.post(f"{base}/{pid}/wait", json={"timeout": 300}, headers=_headers(d),
                        timeout=300)
    assert _digest(_answered_output(answer)) == _digest(expected)


def _slow_stream(d: DaemonProcess, sandbox_id: str, expected: bytes) -> None:
    """Reads one line, lets the command print all the rest, then reads on."""
    got = bytearray()
    with httpx.stream("POST", f"{d.url}/v1/sandboxes/{sandbox_id}/exec/stream",
                      json={"cmd": f"yes streamed | head -c {SIZE}", "output_limit": SIZE * 2},
                      headers=_headers(d), timeout=300) as answer:
        assert answer.status_code == 200
        lines = answer.iter_lines()
        first = True
        for line in lines:
            event = json.loads(line)
            assert "error" not in event, event
            if "exit_code" in event:
                assert event["exit_code"] == 0
                break
            if event["stream"] == "stdout":
                got += base64.b64decode(event["data_b64"]) if "data_b64" in event else (
                    event["data"].encode())
            if first:
                first = False
                time.sleep(2)  # the command runs on while nobody reads
    assert _digest(bytes(got)) == _digest(expected)


def _serves(d: DaemonProcess, sandbox_id: str) -> None:
    assert d.proc is not None and d.proc.poll() is None, d.log()
    assert httpx.get(f"{d.url}/healthz", headers=_headers(d), timeout=30).status_code == 200
    answer = _exec(d, sandbox_id, {"cmd": ["echo", "still here"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["stdout"] == "still here\n"


@pytest.mark.parametrize("kind", PROVIDERS)
def test_concurrent_large_outputs_are_answered_and_the_daemon_stays_bounded(
    daemon: DaemonProcess, kind: str, request: pytest.FixtureRequest
) -> None:
    sandbox_id = _sandbox(daemon, kind, request)
    try:
        callers = Callers()
        for i in range(2):
            text = f"hutch-caller-{i}\n".encode()
            callers.add(f"text-{i}", _printing(
                daemon, sandbox_id, f"yes hutch-caller-{i} | head -c {SIZE}",
                _repeated(text, SIZE)))
        # NULs: valid UTF-8, six bytes each in JSON.
        callers.add("nuls", _printing(daemon, sandbox_id, f"head -c {SIZE} /dev/zero",
                                      bytes(SIZE)))
        # Not UTF-8: base64 on the wire.
        callers.add("binary", _printing(
            daemon, sandbox_id, f"head -c {SIZE} /dev/zero | tr '\\0' '\\377' >&2",
            b"\xff" * SIZE, stream="stderr"))
        callers.add("over-limit", lambda: _over_its_limit(daemon, sandbox_id))
        callers.add("background", lambda: _background_wait(
            daemon, sandbox_id, _repeated(b"background\n", SIZE)))
        callers.add("slow-stream", lambda: _slow_stream(
            daemon, sandbox_id, _repeated(b"streamed\n", SIZE)))

        growth = _peak_growth(daemon, callers.run)

        assert callers.failures == {}, callers.failures
        assert len(callers.answered) == 7
        _serves(daemon, sandbox_id)
        assert growth <= GROWTH_CAP, (
            f"the daemon's resident memory rose by {growth >> 20} MiB for callers "
            f"printing {SIZE >> 20} MiB each (cap {GROWTH_CAP >> 20} MiB)"
        )
    finally:
        _delete(daemon, sandbox_id)


def test_input_over_the_memory_budget_is_refused_and_output_spills(
    small_daemon: DaemonProcess,
) -> None:
    """On a daemon whose budget is smaller than one caller's stdin, that
    caller gets ``daemon_busy``; outputs larger than the budget still come
    whole (they are on disk, not in memory), and the daemon serves on."""
    d = small_daemon
    sandbox_id = _sandbox(d, "bubblewrap-native")
    try:
        callers = Callers()
        stdin = os.urandom(SMALL_BUDGET)

        def too_much_input() -> None:
            answer = _exec(d, sandbox_id, {"cmd": "wc -c",
                                           "stdin_b64": base64.b64encode(stdin).decode()})
            assert answer.status_code == 503, answer.text[:500]
            error = answer.json()["error"]
            assert error["code"] == "daemon_busy", error
            assert "memory" in error["message"], error

        callers.add("too-much-input", too_much_input)
        for i in range(3):
            text = f"spilled-{i}\n".encode()
            callers.add(f"text-{i}", _printing(
                d, sandbox_id, f"yes spilled-{i} | head -c {SIZE}", _repeated(text, SIZE)))
        callers.run()
        assert callers.failures == {}, callers.failures
        # Chunked (no length told ahead): refused when the piece that does
        # not fit comes, on the fast path (exec) and FastAPI's (processes).
        for route in ("exec", "processes"):
            body = json.dumps({"cmd": "wc -c",
                               "stdin_b64": base64.b64encode(stdin).decode()}).encode()
            answer = httpx.post(
                f"{d.url}/v1/sandboxes/{sandbox_id}/{route}",
                content=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]),
                headers={**_headers(d), "Content-Type": "application/json"}, timeout=120,
            )
            assert answer.status_code == 503, (route, answer.text[:500])
            assert answer.json()["error"]["code"] == "daemon_busy", answer.text
        # Input the budget holds is taken as ever.
        small = _exec(d, sandbox_id, {"cmd": "wc -c", "stdin_b64":
                                      base64.b64encode(b"x" * 1000).decode()})
        assert small.status_code == 200 and small.json()["stdout"].strip() == "1000", small.text
        _serves(d, sandbox_id)
    finally:
        _delete(d, sandbox_id)


@pytest.mark.parametrize("stdout, stderr", [
    (b"", b""),
    (b"plain text\n" * 50_000, b"warning\n"),
    # Multi-byte characters cut by every piece's edge, escapes and quotes.
    ("\u00e9\u4e2d\U0001f600\"\\\n\t\x00\x1f\u2028".encode() * 40_000, b""),
    (b"\xff\xfe" * 100_000, "\u00e9".encode() * 100_000),
    # Valid until its last byte, a character cut short.
    (b"a" * 300_000 + "\u4e2d".encode()[:2], b"\x00" * 300_001),
])
@pytest.mark.parametrize("oom_killed", [False, True])
def test_an_answer_read_from_its_spool_is_the_json_of_the_whole(
    stdout: bytes, stderr: bytes, oom_killed: bool,
) -> None:
    """The pieces an exec answer goes out in join up to the JSON the daemon
    renders of the whole result, byte for byte (text and base64 alike)."""
    from hutch._process import ExecOutput, OutputSpool
    from hutch._types import ExecResult, OutputChunk
    from hutch.server.asgi import render_json
    from hutch.server.streaming import exec_json, exec_json_pieces

    spool = OutputSpool()
    # Odd pieces, the two streams' runs interleaved.
    for start in range(0, max(len(stdout), len(stderr)), 7_777):
        for stream, data in (("stdout", stdout), ("stderr", stderr)):
            if data[start:start + 7_777]:
                spool.append(OutputChunk(stream, data[start:start + 7_777]))  # type: ignore[arg-type]
    with ExecOutput(3, spool, oom_killed=oom_killed) as output:
        pieces = list(exec_json_pieces(output))
        whole = render_json(exec_json(ExecResult(3, stdout, stderr, oom_killed=oom_killed)))
        assert b"".join(pieces) == whole
        assert output.result() == ExecResult(3, stdout, stderr, oom_killed=oom_killed)
        assert max(len(p) for p in pieces) <= 6 * 64 * 1024  # escaped, at worst six-fold


def test_background_commands_hold_their_unread_stdin_within_the_budget(
    small_daemon: DaemonProcess,
) -> None:
    """A background command that never reads its stdin keeps it in the
    daemon's memory while it runs: that counts against the budget, so
    starting more such commands is refused (``daemon_busy``) before the
    budget is passed, and once they end the budget is whole again."""
    d = small_daemon
    sandbox_id = _sandbox(d, "bubblewrap-native")
    base = f"{d.url}/v1/sandboxes/{sandbox_id}/processes"
    stdin = base64.b64encode(os.urandom(SMALL_BUDGET // 16)).decode()
    started: list[str] = []
    try:
        refused = None
        for _ in range(17):  # 17 of them hold more than the whole budget
            answer = httpx.post(base, json={"cmd": "sleep 600", "stdin_b64": stdin},
                                headers=_headers(d), timeout=60)
            if answer.status_code != 201:
                refused = answer
                break
            started.append(answer.json()["id"])
        assert refused is not None, f"{len(started)} commands hold their stdin, unbudgeted"
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "daemon_busy"
        assert started, "not even one was taken"
        for pid in started:
            assert httpx.post(f"{base}/{pid}/kill", headers=_headers(d),
                              timeout=60).status_code == 204
        answer = httpx.post(base, json={"cmd": "cat >/dev/null", "stdin_b64": stdin},
                            headers=_headers(d), timeout=60)
        assert answer.status_code == 201, answer.text
        waited = httpx.post(f"{base}/{answer.json()['id']}/wait", json={"timeout": 60},
                            headers=_headers(d), timeout=90)
        assert waited.status_code == 200 and waited.json()["exit_code"] == 0, waited.text
    finally:
        for pid in started:
            httpx.post(f"{base}/{pid}/kill", headers=_headers(d), timeout=60)
        _delete(d, sandbox_id)


@pytest.mark.parametrize("kind", [
    "bubblewrap-native",
    # grep -F in the container sends every line back as a candidate.
    "docker-native",
    # So does grep through pods/exec.
    "kubernetes",
])
def test_a_grep_matching_millions_of_empty_lines_is_cut_at_its_cap(
    daemon: DaemonProcess, kind: str, request: pytest.FixtureRequest
) -> None:
    """Each match costs the answer its place, not only its line's
    characters: a file of empty lines that all match is cut at the grep's
    cap (``output_limit_exceeded``), not answered as millions of matches
    held in the daemon's memory; docker's candidate lines are matched as
    they come, never all held at once."""
    sandbox_id = _sandbox(daemon, kind, request)
    try:
        made = _exec(daemon, sandbox_id,
                     {"cmd": "head -c 4000000 /dev/zero | tr '\\0' '\\n' > empty-lines"})
        assert made.status_code == 200 and made.json()["exit_code"] == 0, made.text

        def grep() -> None:
            answer = httpx.post(f"{daemon.url}/v1/sandboxes/{sandbox_id}/grep",
                                json={"pattern": "^", "timeout": 300},
                                headers=_headers(daemon), timeout=300)
            assert answer.status_code == 413, answer.text[:300]
            assert answer.json()["error"]["code"] == "output_limit_exceeded"

        growth = _peak_growth(daemon, grep)
        _serves(daemon, sandbox_id)
        assert growth <= GROWTH_CAP, f"the daemon grew by {growth >> 20} MiB for one grep"
    finally:
        _delete(daemon, sandbox_id)
