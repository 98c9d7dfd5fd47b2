"""Bounded work: no request stalls the daemon, nothing unrepresentable gets in,
and the daemon's memory stays bounded. Through a real daemon process."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.hazards import sleepers


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    d.close()


@pytest.fixture
def http(daemon: DaemonProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=60) as client:
        yield client


def post_raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """A JSON body as written: Python's json would refuse to send NaN or Infinity."""
    return client.post(path, content=text, headers={"content-type": "application/json"})


def assert_invalid(answer: httpx.Response) -> None:
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_argument", answer.text


def sandbox_ids(client: httpx.Client) -> set[str]:
    listing = client.get("/v1/sandboxes")
    assert listing.status_code == 200, listing.text
    return {s["id"] for s in listing.json()["sandboxes"]}


@pytest.fixture
def local_sandbox(http: httpx.Client) -> Iterator[str]:
    workdir = tempfile.mkdtemp()
    made = http.post("/v1/sandboxes", json={"provider": "local", "workdir": workdir})
    assert made.status_code == 201, made.text
    yield made.json()["id"]
    http.delete(f"/v1/sandboxes/{made.json()['id']}")
    shutil.rmtree(workdir, ignore_errors=True)


# -- nothing unrepresentable gets in --------------------------------------------------


@pytest.mark.parametrize("body", [
    '{"provider": "virtual", "max_lifetime": Infinity}',
    '{"provider": "virtual", "max_lifetime": NaN}',
    '{"provider": "virtual", "idle_timeout": 1e300}',
    '{"provider": "virtual", "idle_suspend_after": -Infinity}',
    '{"provider": "virtual", "output_limit": 1000000000000}',
    '{"provider": "docker", "cpus": Infinity}',
    '{"provider": "docker", "pids_limit": 100000000000}',
])
def test_unrepresentable_numbers_make_nothing(http: httpx.Client, body: str) -> None:
    before = sandbox_ids(http)
    assert_invalid(post_raw(http, "/v1/sandboxes", body))
    # Nothing was made, and listing still answers for everyone.
    assert sandbox_ids(http) == before


@pytest.mark.parametrize("seconds", ["-1", "0", "NaN", "-Infinity"])
def test_set_timeout_takes_a_positive_finite_number(http: httpx.Client, seconds: str) -> None:
    made = http.post("/v1/sandboxes", json={"provider": "virtual"})
    sid = made.json()["id"]
    try:
        assert_invalid(post_raw(http, f"/v1/sandboxes/{sid}/set_timeout",
                                f'{{"timeout_seconds": {seconds}}}'))
        assert_invalid(post_raw(http, "/v1/set_timeout",
                                f'{{"sandbox": "{sid}", "timeout_seconds": {seconds}}}'))
        # Refused, so nothing changed: the sandbox runs with no deadline.
        state = http.get(f"/v1/sandboxes/{sid}").json()
        assert (state["state"], state["deadline_unix"]) == ("running", None)
    finally:
        http.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize("body", [
    '{"cmd": "true", "output_limit": 1000000000000}',
    '{"cmd": "true", "timeout": Infinity}',
    '{"cmd": "true", "timeout": NaN}',
    '{"cmd": "true", "timeout": 1e300}',
])
def test_exec_numbers_have_ceilings(http: httpx.Client, local_sandbox: str, body: str) -> None:
    assert_invalid(post_raw(http, f"/v1/sandboxes/{local_sandbox}/exec", body))
    assert_invalid(post_raw(http, f"/v1/sandboxes/{local_sandbox}/processes", body))


def test_read_and_list_limits_have_ceilings(http: httpx.Client, local_sandbox: str) -> None:
    for limit in ("1000000000000", "0", "-5"):
        assert_invalid(http.get(f"/v1/sandboxes/{local_sandbox}/files",
                                params={"path": "x", "limit": limit}))
    for limit in ("1000000000", "-1"):
        assert_invalid(http.get("/v1/events", params={"limit": limit}))
    assert http.get("/v1/events", params={"limit": "5"}).status_code == 200


def test_wait_timeout_is_finite(http: httpx.Client, local_sandbox: str) -> None:
    started = http.post(f"/v1/sandboxes/{local_sandbox}/processes", json={"cmd": "true"})
    assert started.status_code == 201, started.text
    pid = started.json()["id"]
    for timeout in ("Infinity", "NaN", "1e300"):
        assert_invalid(post_raw(http, f"/v1/sandboxes/{local_sandbox}/processes/{pid}/wait",
                                json.dumps({"timeout": 1}).replace("1", timeout)))


# -- defaults a user would expect ------------------------------------------------------


def test_local_sandbox_without_workdir_gets_a_fresh_one(
    daemon: DaemonProcess, http: httpx.Client
) -> None:
    made = [http.post("/v1/sandboxes", json={"provider": "local"}) for _ in range(2)]
    assert all(m.status_code == 201 for m in made), [m.text for m in made]
    ids = [m.json()["id"] for m in made]
    workdirs = [m.json()["workdir"] for m in made]
    try:
        assert workdirs[0] != workdirs[1]
        for workdir in workdirs:
            assert workdir.startswith(daemon.data_dir.rstrip("/") + "/"), workdir
            assert os.listdir(workdir) == []
        # Each is its own: what one writes, the other does not see.
        wrote = http.post(f"/v1/sandboxes/{ids[0]}/exec", json={"cmd": "echo x > mine; pwd"})
        assert wrote.json()["stdout"].strip() == workdirs[0]
        assert os.listdir(workdirs[1]) == []
    finally:
        for sid in ids:
            assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204
    # hutch made them, so hutch removes them with their sandbox.
    assert not any(os.path.exists(w) for w in workdirs)


@pytest.mark.anyio
async def test_in_process_local_sandbox_gets_a_fresh_workdir_under_hutch_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HUTCH_HOME", str(tmp_path))
    async with await hutch.create_sandbox() as sandbox:
        assert sandbox.workdir.startswith(str(tmp_path) + "/")
        assert sandbox.workdir != os.getcwd()
        await sandbox.write_text("f", "x")
        workdir = sandbox.workdir
    assert not os.path.exists(workdir)


@pytest.mark.anyio
async def test_a_given_local_workdir_is_kept(tmp_path: Path) -> None:
    async with await hutch.create_sandbox(provider="local", workdir=str(tmp_path)) as sandbox:
        await sandbox.write_text("f", "x")
    assert (tmp_path / "f").read_text() == "x"


# -- one request never stalls the daemon -------------------------------------------------

BACKTRACKING = "(a+)+$"  # over a line of a's and a '!': 2^n steps in Python's re


def grep_workers(daemon: DaemonProcess) -> dict[int, str]:
    """pid -> state (R running, S sleeping...) of the daemon's grep worker processes."""
    assert daemon.proc is not None
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if int(fields[1]) == daemon.proc.pid and b"_grepworker" in cmdline:
            found[int(entry)] = fields[0]
    return found


class HealthProbe:
    """Polls /healthz from a thread, recording the slowest answer."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.url = f"{daemon.url}/healthz"
        self.headers = {"Authorization": f"Bearer {daemon.token}"}
        self.slowest = 0.0
        self.answers = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(headers=self.headers, timeout=5) as client:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    ok = client.get(self.url).status_code == 200
                except httpx.HTTPError as exc:
                    ok = False
                    self.failures.append(repr(exc))
                self.slowest = max(self.slowest, time.monotonic() - began)
                self.answers += ok
                time.sleep(0.1)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_backtracking_grep_times_out_without_stalling_the_daemon(
    daemon: DaemonProcess, http: httpx.Client, local_sandbox: str
) -> None:
    base = f"/v1/sandboxes/{local_sandbox}"
    assert http.put(f"{base}/files", params={"path": "bad.txt"},
                    content=b"a" * 27 + b"!\n").status_code == 204
    with HealthProbe(daemon) as probe:
        began = time.monotonic()
        answer = http.post(f"{base}/grep", json={"pattern": BACKTRACKING, "timeout": 2})
        took = time.monotonic() - began
        # While it ran, other calls were answered too.
        assert http.post(f"{base}/exec", json={"cmd": "echo ok"}).json()["stdout"] == "ok\n"
    assert answer.status_code == 408, answer.text
    assert answer.json()["error"]["code"] == "exec_timeout"
    assert took < 10, took
    assert probe.answers >= 5 and not probe.failures, (probe.answers, probe.failures)
    assert probe.slowest < 1.0, probe.slowest
    # What the grep started is gone: no worker is still matching.
    time.sleep(0.5)
    assert "R" not in grep_workers(daemon).values()
    # A sane pattern on the same file answers as before.
    fine = http.post(f"{base}/grep", json={"pattern": "a!$"})
    assert fine.status_code == 200, fine.text
    assert [m["line_number"] for m in fine.json()["matches"]] == [1]


def test_grep_skips_what_is_not_a_regular_file(
    http: httpx.Client, local_sandbox: str
) -> None:
    base = f"/v1/sandboxes/{local_sandbox}"
    workdir = http.get(base).json()["workdir"]
    os.mkfifo(os.path.join(workdir, "pipe"))
    os.symlink("pipe", os.path.join(workdir, "link-to-pipe"))
    assert http.put(f"{base}/files", params={"path": "text"},
                    content=b"needle\n").status_code == 204
    began = time.monotonic()
    found = http.post(f"{base}/grep", json={"pattern": "needle", "timeout": 20})
    assert found.status_code == 200, found.text
    assert [m["path"] for m in found.json()["matches"]] == [os.path.join(workdir, "text")]
    alone = http.post(f"{base}/grep", json={"pattern": "x", "path": "pipe", "timeout": 20})
    assert (alone.status_code, alone.json()) == (200, {"matches": []})
    # A read of a FIFO is refused at once, never left waiting for a writer.
    read = http.get(f"{base}/files", params={"path": "pipe"})
    assert read.status_code == 400, read.text
    assert "not a regular file" in read.json()["error"]["message"]
    assert time.monotonic() - began < 15
    assert http.post(f"{base}/glob", json={"pattern": "*"}).json()["paths"] == [
        os.path.join(workdir, "text")
    ]


@pytest.mark.parametrize("path", ["/dev", "/proc/self", "/proc/1"])
def test_grep_over_special_trees_returns_or_times_out(
    daemon: DaemonProcess, http: httpx.Client, local_sandbox: str, path: str
) -> None:
    with HealthProbe(daemon) as probe:
        began = time.monotonic()
        answer = http.post(f"/v1/sandboxes/{local_sandbox}/grep",
                           json={"pattern": "zz-never-there", "path": path, "timeout": 5})
        took = time.monotonic() - began
    assert answer.status_code in (200, 408), answer.text
    if answer.status_code == 200:
        assert answer.json()["matches"] == []
    assert took < 15, took
    assert probe.slowest < 1.0, probe.slowest


def test_grep_over_a_hundred_thousand_files_returns_or_times_out(
    daemon: DaemonProcess, http: httpx.Client
) -> None:
    # On tmpfs where there is one: the tree is the test's input, not its subject.
    workdir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        subprocess.run(
            ["bash", "-c", "mkdir d{0..99} && for d in d*; do (cd $d && touch f{0..999}); done"],
            cwd=workdir, check=True,
        )
        made = http.post("/v1/sandboxes", json={"provider": "local", "workdir": workdir})
        sid = made.json()["id"]
        with HealthProbe(daemon) as probe:
            began = time.monotonic()
            answer = http.post(f"/v1/sandboxes/{sid}/grep",
                               json={"pattern": "needle", "timeout": 10})
            took = time.monotonic() - began
        http.delete(f"/v1/sandboxes/{sid}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert answer.status_code in (200, 408), answer.text
    if answer.status_code == 200:
        assert answer.json()["matches"] == []
    assert took < 20, took
    assert probe.slowest < 1.0, probe.slowest


# -- the daemon's memory is bounded -------------------------------------------------------


def rss_bytes(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_background_output_does_not_stay_in_the_daemons_memory(
    daemon: DaemonProcess, http: httpx.Client, local_sandbox: str
) -> None:
    base = f"/v1/sandboxes/{local_sandbox}"
    before = rss_bytes(daemon)
    started = [
        # Printable output: each answer's JSON is its size, not six times it (\u0000).
        http.post(f"{base}/processes", json={"cmd": "yes | head -c 15000000"}).json()["id"]
        for _ in range(30)
    ]
    for pid in started:
        # Each still answers in full...
        done = http.post(f"{base}/processes/{pid}/wait", json={"timeout": 120})
        assert done.status_code == 200, done.text
        assert len(done.json()["stdout"]) == 15_000_000
    # ...but 450 MB of output is not held in the daemon (spooled to disk).
    grown = rss_bytes(daemon) - before
    assert grown < 150 * 1024 * 1024, f"the daemon grew by {grown / 2**20:.0f} MiB"


def test_finished_background_commands_are_forgotten(
    http: httpx.Client, local_sandbox: str
) -> None:
    base = f"/v1/sandboxes/{local_sandbox}"
    started = [http.post(f"{base}/processes", json={"cmd": "true"}).json()["id"]
               for _ in range(80)]
    for pid in started[-5:]:
        assert http.post(f"{base}/processes/{pid}/wait", json={"timeout": 60}).status_code == 200
    deadline = time.monotonic() + 30
    while any(p["running"] for p in http.get(f"{base}/processes").json()["processes"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    kept = {p["id"] for p in http.get(f"{base}/processes").json()["processes"]}
    assert len(kept) <= 64, len(kept)
    assert started[-1] in kept  # the newest stay, the oldest go first
    gone = http.get(f"{base}/processes/{started[0]}")
    assert gone.status_code == 404, gone.text


def test_request_bodies_have_a_ceiling(daemon: DaemonProcess, local_sandbox: str) -> None:
    # Announced as 1 GiB: refused before a byte of it is read.
    request = (
        f"PUT /v1/sandboxes/{local_sandbox}/files?path=big HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nAuthorization: Bearer {daemon.token}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {2**30}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(request)
        answer = ""
        while "}}" not in answer and (piece := sock.recv(65536)):
            answer += piece.decode()
    assert answer.startswith("HTTP/1.1 413"), answer
    assert "output_limit_exceeded" in answer and str(256 * 1024 * 1024) in answer, answer


# -- acceptance: a sandbox under abuse does not take the daemon down -------------------------


def commands_named(sandbox_id: str, name: str) -> int:
    """How many processes run ``name`` in a docker sandbox, seen from the host."""
    import docker

    api = docker.APIClient()
    [container] = api.containers(filters={"label": f"hutch.sandbox_id={sandbox_id}"})
    top = api.top(container["Id"], ps_args="-e -o pid,args")
    return sum(1 for row in top.get("Processes") or [] if row[1] == name)


@pytest.mark.docker
def test_one_abused_docker_sandbox_leaves_the_daemon_and_others_working(
    daemon: DaemonProcess, http: httpx.Client
) -> None:
    made = [
        http.post("/v1/sandboxes", json={
            "provider": "docker", "image": TEST_IMAGE, "memory": "128m", "pids_limit": 128,
        })
        for _ in range(2)
    ]
    assert all(m.status_code == 201 for m in made), [m.text for m in made]
    abused, other = (f"/v1/sandboxes/{m.json()['id']}" for m in made)
    abused_id = made[0].json()["id"]
    assert http.put(f"{abused}/files", params={"path": "bad.txt"},
                    content=b"a" * 27 + b"!\n").status_code == 204
    abuses = {
        "fork bomb": ("exec", {"cmd": "f() { f | f & }; f; sleep 20", "timeout": 8}),
        "memory hog": ("exec", {"cmd": "head -c 1000000000 /dev/zero | tail", "timeout": 30}),
        "output flood": ("exec", {"cmd": "yes", "timeout": 30}),
        "background flood": ("processes", {"cmd": "yes"}),
        "backtracking grep": ("grep", {"pattern": BACKTRACKING, "timeout": 5}),
    }
    answers: dict[str, httpx.Response | BaseException] = {}

    def abuse(name: str, route: str, body: dict[str, object]) -> None:
        try:
            with httpx.Client(base_url=daemon.url, timeout=120,
                              headers={"Authorization": f"Bearer {daemon.token}"}) as c:
                answers[name] = c.post(f"{abused}/{route}", json=body)
        except BaseException as exc:
            answers[name] = exc

    others_ok = 0
    try:
        with HealthProbe(daemon) as probe:
            threads = {name: threading.Thread(target=abuse, args=(name, *how))
                       for name, how in abuses.items()}
            for name, thread in threads.items():
                if name != "fork bomb":
                    thread.start()
            # The bomb goes off once the floods run: a command it keeps from
            # starting would answer that, not what its own abuse makes it answer.
            deadline = time.monotonic() + 20
            while ((commands_named(abused_id, "yes") < 2 and "output flood" not in answers)
                   or (commands_named(abused_id, "tail") < 1 and "memory hog" not in answers)):
                assert time.monotonic() < deadline, "the floods and the hog did not start"
                time.sleep(0.05)
            threads["fork bomb"].start()
            while any(t.is_alive() for t in threads.values()):
                # Meanwhile another sandbox works as ever.
                answer = http.post(f"{other}/exec", json={"cmd": "echo ok", "timeout": 30})
                assert answer.status_code == 200 and answer.json()["stdout"] == "ok\n", answer.text
                others_ok += 1
                time.sleep(0.2)
            for thread in threads.values():
                thread.join()
        assert probe.answers >= 10 and not probe.failures, (probe.answers, probe.failures)
        assert probe.slowest < 1.0, f"/healthz took {probe.slowest:.2f} s"
        assert others_ok >= 3
        for name, answer in answers.items():
            assert isinstance(answer, httpx.Response), (name, answer)
            assert answer.status_code != 500, (name, answer.text)
        assert answers["backtracking grep"].status_code == 408  # type: ignore[union-attr]
        assert answers["output flood"].status_code == 413, answers["output flood"].text  # type: ignore[union-attr]
    finally:
        for sandbox in (abused, other):
            http.delete(sandbox)


def test_a_client_gone_cancels_what_its_call_started(
    daemon: DaemonProcess, http: httpx.Client, local_sandbox: str
) -> None:
    marker = f"{time.time_ns() % 10**6 + 1000}.5"  # a sleep no one else runs

    def call() -> None:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and goes
            http.post(f"/v1/sandboxes/{local_sandbox}/exec",
                      json={"cmd": ["sleep", marker]}, timeout=3)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 3
    while not sleepers(marker):
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.05)
    caller.join()
    deadline = time.monotonic() + 10
    while sleepers(marker):
        assert time.monotonic() < deadline, "the command outlived its caller"
        time.sleep(0.2)


def peak_rss_bytes(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def upload_peak_growth(settings: dict[str, object], check: Callable[[str, str], None]) -> int:
    """How much a fresh daemon's peak memory grows over two 200 MiB uploads
    (through the fast path and through FastAPI) into a sandbox of ``settings``."""
    fresh = DaemonProcess().start()
    size = 200 * 1024 * 1024
    try:
        with httpx.Client(base_url=fresh.url, timeout=300,
                          headers={"Authorization": f"Bearer {fresh.token}"}) as client:
            made = client.post("/v1/sandboxes", json={**settings, "read_before_write": False})
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            before = peak_rss_bytes(fresh)
            block = os.urandom(1024 * 1024)
            for content_type in ("application/octet-stream", "application/x-hutch-other"):
                sent = client.put(f"/v1/sandboxes/{sid}/files", params={"path": "big.bin"},
                                  content=(block for _ in range(size // len(block))),
                                  headers={"content-type": content_type})
                assert sent.status_code == 204, sent.text
                stat = client.get(f"/v1/sandboxes/{sid}/stat", params={"path": "big.bin"})
                assert stat.json()["size"] == size, stat.text
            grown = peak_rss_bytes(fresh) - before
            check(sid, made.json()["workdir"])
            client.delete(f"/v1/sandboxes/{sid}")
            return grown
    finally:
        fresh.close()


def test_an_upload_streams_to_disk_not_into_the_daemons_memory() -> None:
    workdir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)

    def same_bytes(sid: str, _: str) -> None:
        with open(os.path.join(workdir, "big.bin"), "rb") as fh:
            assert len(fh.read(1024 * 1024)) == 1024 * 1024

    try:
        grown = upload_peak_growth({"provider": "local", "workdir": workdir}, same_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert grown < 64 * 1024 * 1024, f"the daemon's peak grew by {grown / 2**20:.0f} MiB"


def test_a_download_streams_out_of_a_local_sandbox() -> None:
    fresh = DaemonProcess().start()
    workdir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    size = 200 * 1024 * 1024 + 3
    with open(os.path.join(workdir, "big.bin"), "wb") as fh:
        fh.truncate(size)
        fh.seek(size - 3)
        fh.write(b"end")
    try:
        with httpx.Client(base_url=fresh.url, timeout=300,
                          headers={"Authorization": f"Bearer {fresh.token}"}) as client:
            sid = client.post("/v1/sandboxes", json={"provider": "local", "workdir": workdir})
            sid = sid.json()["id"]
            before = peak_rss_bytes(fresh)
            for params in ({"path": "big.bin"}, {"path": "big.bin", "limit": "x"}):
                with client.stream("GET", f"/v1/sandboxes/{sid}/files", params=params) as got:
                    if params.get("limit") == "x":
                        assert got.status_code == 400  # FastAPI's answer to a bad limit
                        continue
                    assert got.status_code == 200
                    received, tail = 0, b""
                    for piece in got.iter_bytes():
                        received += len(piece)
                        tail = (tail + piece)[-3:]
                assert (received, tail) == (size, b"end")
            grown = peak_rss_bytes(fresh) - before
            assert grown < 64 * 1024 * 1024, f"the daemon's peak grew by {grown / 2**20:.0f} MiB"
            # Small files and errors answer as before.
            assert client.get(f"/v1/sandboxes/{sid}/files",
                              params={"path": "big.bin", "limit": "1000"}).status_code == 413
            small = os.path.join(workdir, "small")
            with open(small, "w") as fh:
                fh.write("hi")
            assert client.get(f"/v1/sandboxes/{sid}/files", params={"path": "small"}).text == "hi"
    finally:
        fresh.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.docker
def test_docker_grep_skips_fifos_and_bounds_special_trees(
    daemon: DaemonProcess, http: httpx.Client
) -> None:
    made = http.post("/v1/sandboxes", json={"provider": "docker", "image": TEST_IMAGE})
    assert made.status_code == 201, made.text
    base = f"/v1/sandboxes/{made.json()['id']}"
    try:
        setup = http.post(f"{base}/exec", json={
            "cmd": "mkfifo pipe && ln -s pipe link-to-pipe && echo needle > text"})
        assert setup.json()["exit_code"] == 0, setup.text
        found = http.post(f"{base}/grep", json={"pattern": "needle", "timeout": 20})
        assert found.status_code == 200, found.text
        assert [m["path"] for m in found.json()["matches"]] == ["/workspace/text"]
        alone = http.post(f"{base}/grep", json={"pattern": "x", "path": "pipe", "timeout": 20})
        assert (alone.status_code, alone.json()) == (200, {"matches": []})
        with HealthProbe(daemon) as probe:
            for path in ("/dev", "/proc"):
                began = time.monotonic()
                answer = http.post(f"{base}/grep", json={
                    "pattern": "zz-never-there", "path": path, "timeout": 5})
                assert answer.status_code in (200, 408), answer.text
                assert time.monotonic() - began < 15
        assert probe.slowest < 1.0, probe.slowest
    finally:
        http.delete(base)


@pytest.mark.anyio
async def test_grep_skips_a_file_that_claims_to_be_small_and_never_ends(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("needle\n" * 100)
    async with await hutch.create_sandbox("local", workdir=str(tmp_path)) as sandbox:
        # /proc/self/status says 0 bytes and reads on past the limit (as
        # /proc/1/pagemap does for gigabytes).
        assert await sandbox.grep("Name", "/proc/self/status", limit=100) == []
        # A file that really is over the limit is still an error, naming it.
        with pytest.raises(hutch.OutputLimitExceeded, match=r"big\.txt"):
            await sandbox.grep("needle", ".", limit=100)
        assert len(await sandbox.grep("needle", ".")) == 100


def test_a_grep_that_matches_everything_is_capped(
    http: httpx.Client, local_sandbox: str
) -> None:
    base = f"/v1/sandboxes/{local_sandbox}"
    line = b"x" * 99 + b"\n"
    for name in ("a", "b", "c"):  # 24 MB of lines, over the 16 MiB cap together
        assert http.put(f"{base}/files", params={"path": f"many/{name}"},
                        content=line * 80_000).status_code == 204
    answer = http.post(f"{base}/grep", json={"pattern": "x", "path": "many", "timeout": 60})
    assert answer.status_code == 413, answer.text[:300]
    assert "output_limit_exceeded" in answer.text and "narrow" in answer.text
    one = http.post(f"{base}/grep", json={"pattern": "x", "path": "many/a", "timeout": 60})
    assert one.status_code == 200 and len(one.json()["matches"]) == 80_000


PROVIDER_KINDS = [
    pytest.param("docker-native", marks=pytest.mark.docker),
    pytest.param("docker-agent", marks=pytest.mark.docker),
    pytest.param("bubblewrap-native", marks=pytest.mark.docker),
    pytest.param("bubblewrap-agent", marks=pytest.mark.docker),
    "ssh",
]


@contextlib.contextmanager
def provider_settings(kind: str) -> Iterator[tuple[dict[str, object], tuple[str, ...]]]:
    """(sandbox settings, daemon flags) for a provider-runtime ``kind``."""
    provider, _, runtime = kind.partition("-")
    settings: dict[str, object] = {"provider": provider, "read_before_write": False}
    if provider != "ssh":
        yield {**settings, "image": TEST_IMAGE, "runtime": runtime}, ()
        return
    from tests.ssh_server import ALIAS, shared_server

    workdir = tempfile.mkdtemp(prefix="hutch-ssh-")
    try:
        yield ({**settings, "destination": ALIAS, "working_directory": workdir,
                "config_file": shared_server().config_file},
               ("--allow-provider", "ssh", "--allow", "destination", "--allow", "config_file"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_a_large_file_streams_in_and_out_of_every_provider(kind: str) -> None:
    """~200 MB written and read back through a daemon, on each provider and
    runtime: the daemon's peak memory grows by far less than the file, and
    every byte arrives both ways (the sandbox's own hash says so)."""
    with provider_settings(kind) as (settings, extra):
        round_trip_through_a_fresh_daemon(settings, extra)


def round_trip_through_a_fresh_daemon(
    settings: dict[str, object], extra: tuple[str, ...]
) -> None:
    fresh = DaemonProcess(extra_args=extra).start()
    block = os.urandom(1024 * 1024)
    blocks, tail = 200, b"the end"
    sent = hashlib.sha256()
    for _ in range(blocks):
        sent.update(block)
    sent.update(tail)
    try:
        with httpx.Client(base_url=fresh.url, timeout=300,
                          headers={"Authorization": f"Bearer {fresh.token}"}) as client:
            made = client.post("/v1/sandboxes", json=settings)
            assert made.status_code == 201, made.text
            base = f"/v1/sandboxes/{made.json()['id']}"
            try:
                before = peak_rss_bytes(fresh)
                put = client.put(f"{base}/files", params={"path": "big.bin"},
                                 content=itertools.chain((block for _ in range(blocks)), [tail]),
                                 headers={"content-type": "application/octet-stream"})
                assert put.status_code == 204, put.text
                hashed = client.post(f"{base}/exec", json={"cmd": "sha256sum big.bin"})
                assert hashed.json()["stdout"].split()[0] == sent.hexdigest(), hashed.text
                got_hash, received = hashlib.sha256(), 0
                with client.stream("GET", f"{base}/files", params={"path": "big.bin"}) as got:
                    assert got.status_code == 200, got.read()[:300]
                    for piece in got.iter_bytes():
                        got_hash.update(piece)
                        received += len(piece)
                grown = peak_rss_bytes(fresh) - before
                assert received == blocks * len(block) + len(tail)
                assert got_hash.hexdigest() == sent.hexdigest()
                assert grown < 64 * 1024 * 1024, (
                    f"the daemon's peak grew by {grown / 2**20:.0f} MiB")
                # The limit still holds, told before a byte moves.
                over = client.get(f"{base}/files", params={"path": "big.bin", "limit": "1000"})
                assert over.status_code == 413, over.text
            finally:
                client.delete(base)
    finally:
        fresh.stop()
        shutil.rmtree(fresh.data_dir, ignore_errors=True)
