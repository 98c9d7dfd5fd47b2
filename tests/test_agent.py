"""hutch's agent as a docker sandbox's keeper and runtime: what it is, images
it runs in, its failures, and what a sandbox's processes can do with it."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tarfile
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import docker
import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers.agent import AgentFailure, AgentRuntime
from hutch.providers.agent.wire import Channel, connect_socket
from hutch.states import SandboxState
from tests.conftest import TEST_IMAGE
from tests.hazards import answers_beside_busy_loops, cpu_cgroup, fill_with_processes

pytestmark = pytest.mark.anyio

NO_SHELL_IMAGE = "hutch-test-noshell:bookworm"
#: What makes an image one with no shell and no Python (bookworm merges /bin
#: into /usr/bin).
_REMOVED = ("usr/bin/sh", "usr/bin/bash", "usr/bin/dash", "usr/bin/rbash", "bin/sh", "bin/bash")


def no_shell_image() -> str:
    """A Debian root with sh, bash and python3 removed, made once from the
    cached rootfs tarball (scripts/ensure-docker.sh), with no registry."""
    api = docker.APIClient()
    try:
        api.inspect_image(NO_SHELL_IMAGE)
        return NO_SHELL_IMAGE
    except docker.errors.ImageNotFound:
        pass
    source = os.path.join(os.environ.get("HUTCH_CACHE_DIR", "/var/cache/hutch"),
                          "bookworm-minbase.tar")
    with tempfile.NamedTemporaryFile(suffix=".tar") as out:
        with tarfile.open(source) as src, tarfile.open(fileobj=out, mode="w") as dst:
            for member in src:
                name = member.name.removeprefix("./")
                if name in _REMOVED or name.startswith("usr/bin/python"):
                    continue
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        out.flush()
        out.seek(0)
        api.import_image_from_data(out.read(), repository="hutch-test-noshell", tag="bookworm")
    return NO_SHELL_IMAGE


@pytest.fixture
async def sb() -> AsyncIterator[Any]:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="agent", read_before_write=False
    ) as sandbox:
        yield sandbox


async def agent_pid(sb: Any) -> int:
    return int(await sb.read_text("/.hutch/run/agent.sock.pid"))


async def eventually(check: Callable[[], Any], within: float) -> float:
    started = time.monotonic()
    last: BaseException | None = None
    while time.monotonic() - started < within:
        try:
            if await check():
                return time.monotonic() - started
        except Exception as exc:
            last = exc
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {within} s (last error: {last!r})")


# -- the keeper ------------------------------------------------------------------------


@pytest.mark.docker
async def test_the_agent_is_the_keeper_and_the_runtime(sb: Any) -> None:
    assert sb.capabilities.runtime == "agent"
    pid = await agent_pid(sb)
    cmdline = (await sb.read_bytes(f"/proc/{pid}/cmdline")).split(b"\0")
    assert cmdline[0] == b"/.hutch/bin/hutch-agent"
    listing = await sb.exec(["ps", "-eo", "args"])
    assert "sleep infinity" not in listing.stdout
    # Read-only: nothing in the sandbox can change the program that serves it.
    attempt = await sb.exec(["sh", "-c", "echo x > /.hutch/bin/hutch-agent"])
    assert attempt.exit_code != 0


@pytest.mark.docker
@pytest.mark.parametrize("init", [True, False])
async def test_orphans_are_reaped(init: bool) -> None:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="agent", init=init
    ) as sb:
        # Each shell leaves its background child an orphan, which dies soon.
        for _ in range(5):
            await sb.exec(["sh", "-c", "sleep 0.2 & exit 0"])
        await asyncio.sleep(1)
        states = (await sb.exec(["ps", "-eo", "stat="])).stdout.split()
        assert not [s for s in states if s.startswith("Z")], states
        assert await backend_of(sb).runtime.count_busy_processes() == 0


@pytest.mark.docker
async def test_busy_count_sees_a_nohup_job_and_not_the_keepers(sb: Any) -> None:
    assert await backend_of(sb).runtime.count_busy_processes() == 0
    await sb.exec("nohup sleep 60 >/dev/null 2>&1 &")
    assert await backend_of(sb).runtime.count_busy_processes() == 1
    await sb.exec("pkill -f 'sleep 60'; true")
    await eventually(lambda: _equals(backend_of(sb).runtime.count_busy_processes(), 0), within=3)


async def _equals(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


# -- images and networks ------------------------------------------------------------------


@pytest.mark.docker
async def test_an_image_with_no_shell_and_no_python_works_for_argv_and_files() -> None:
    image = await asyncio.to_thread(no_shell_image)
    async with await hutch.create_sandbox(
        "docker", image=image, runtime="agent", read_before_write=False
    ) as sb:
        assert sb.capabilities.runtime == "agent"
        assert (await sb.exec(["ls", "/usr/bin/bash"])).exit_code != 0
        assert (await sb.exec(["ls", "/usr/bin/python3"])).exit_code != 0
        result = await sb.exec(["cat"], stdin=b"no shell needed")
        assert result.stdout == "no shell needed"
        await sb.write_bytes("deep/er/f i l e.bin", b"\0\1binary\n" * 1000)
        assert await sb.read_bytes("deep/er/f i l e.bin") == b"\0\1binary\n" * 1000
        await sb.write_text("deep/notes.txt", "alpha\nbeta\n")
        assert [m.line for m in await sb.grep("bet")] == ["beta"]
        assert await sb.glob("**/*.txt") == ["/workspace/deep/notes.txt"]
        assert [e.name for e in await sb.list_dir("deep")] == ["er", "notes.txt"]
        await sb.remove("deep", recursive=True)
        assert not await sb.exists("deep")
        # A shell string has no shell to run in: a typed error, not a hang.
        with pytest.raises(hutch.SandboxFileNotFound):
            await sb.exec("echo hi")


@pytest.mark.docker
async def test_network_none_works_through_the_agent() -> None:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="agent", network_mode="none",
        read_before_write=False,
    ) as sb:
        assert sb.capabilities.runtime == "agent"
        interfaces = await sb.exec(["ls", "/sys/class/net"])
        assert interfaces.stdout.split() == ["lo"]
        await sb.write_text("x.txt", "offline")
        assert (await sb.exec(["cat", "x.txt"])).stdout == "offline"


# -- failures ------------------------------------------------------------------------------


@pytest.mark.docker
async def test_kill_9_of_pid_1_from_inside_changes_nothing(sb: Any) -> None:
    await sb.exec(["kill", "-9", "1"])
    assert (await sb.exec(["echo", "still here"])).stdout == "still here\n"


@pytest.mark.docker
async def test_killing_the_agent_gives_a_typed_error_and_recovers_or_fails_within_5s(
    sb: Any,
) -> None:
    await sb.write_text("/root/kept.txt", "kept")
    pid = await agent_pid(sb)
    started = time.monotonic()
    with pytest.raises(hutch.HutchError) as info:
        # The agent dies under this very command: its connection breaks.
        await sb.exec(["sh", "-c", f"kill -9 {pid}; sleep 30"])
    assert info.value.code in ("provider_error", "sandbox_unavailable")
    assert time.monotonic() - started < 5

    async def settled() -> bool:
        if sb.state == SandboxState.FAILED:
            return True
        return bool((await sb.exec(["cat", "/root/kept.txt"])).stdout == "kept")

    await eventually(settled, within=5)
    if sb.state != SandboxState.FAILED:
        assert await agent_pid(sb) > 0  # a new agent serves


@pytest.mark.docker
async def test_a_wedged_agent_is_detected_and_restarted(sb: Any) -> None:
    await sb.write_text("/root/kept.txt", "kept")
    pid = await agent_pid(sb)
    # Stopped a moment after this exec has had its answer.
    await sb.exec(f"nohup sh -c 'sleep 0.3; kill -STOP {pid}' >/dev/null 2>&1 &")
    await asyncio.sleep(1)
    started = time.monotonic()
    try:
        result = await sb.exec(["cat", "/root/kept.txt"])
    except hutch.HutchError as exc:
        assert exc.code in ("provider_error", "sandbox_unavailable")
    else:
        assert result.stdout == "kept"  # found wedged, restarted, and tried again
    assert time.monotonic() - started < 8
    assert (await sb.exec(["cat", "/root/kept.txt"])).stdout == "kept"
    assert await agent_pid(sb) != 0


# -- trust: what the host accepts ----------------------------------------------------------


class _FakeAgent:
    """A unix socket server that answers every connection with ``reply``: the
    agent as a hostile sandbox could make it (it cannot run in a container of
    ours on demand, so this one stands in for the bytes on the wire)."""

    def __init__(
        self, path: str, reply: bytes, *, close: bool, fds: list[int] | None = None
    ) -> None:
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        self.server.listen(8)
        self.reply, self.close, self.fds = reply, close, fds or []
        self.kept: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
                conn.recv(65536)
                if self.fds:
                    socket.send_fds(conn, [self.reply], self.fds)
                else:
                    conn.sendall(self.reply)
            except OSError:
                return  # the host hung up first: what a test wants
            if self.close:
                conn.close()
            else:
                self.kept.append(conn)


def _frame(header: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">II", len(header), len(payload)) + header + payload


@pytest.fixture
def fake_agent_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="hutch-fake-agent-") as d:
        yield d


@pytest.mark.parametrize(
    ("reply", "close"),
    [
        (struct.pack(">II", 64 << 20, 0), False),  # a header past the bound
        (struct.pack(">II", 10, 512 << 20), False),  # a payload past the bound
        (_frame(b"not json"), False),
        (_frame(b'["a list"]'), False),
        (_frame(b'{"t": "ok"}')[:7], True),  # the connection ends mid-frame
        (b"", False),  # silence
        (_frame(b'{"t": "ok", "path": 5, "type": "file"}'), False),  # wrong field types
    ],
    ids=["huge-header", "huge-payload", "not-json", "not-an-object", "cut", "silent", "types"],
)
async def test_anything_malformed_from_the_agent_is_a_provider_error(
    fake_agent_dir: str, reply: bytes, close: bool
) -> None:
    path = os.path.join(fake_agent_dir, "agent.sock")
    _FakeAgent(path, reply, close=close)
    recoveries: list[str] = []

    async def recover(reason: str) -> bool:
        recoveries.append(reason)
        return True

    runtime = AgentRuntime("sb-fake", "/workspace", path, provider_name="docker",
                           recover=recover)
    started = time.monotonic()
    with pytest.raises(hutch.ProviderError):
        await runtime.stat("/workspace/x")
    assert time.monotonic() - started < 6  # never a hang
    assert recoveries, "the provider was not told its agent failed"


@pytest.mark.parametrize("extra", [0, 3], ids=["a-pipe", "too-many"])
async def test_a_descriptor_handed_over_is_checked(fake_agent_dir: str, extra: int) -> None:
    # A pipe where a file was promised would block a read; descriptors nobody
    # asked for are refused too.
    path = os.path.join(fake_agent_dir, "agent.sock")
    pipe_r, pipe_w = os.pipe()
    fds = [pipe_r] * (1 + extra)
    _FakeAgent(path, _frame(b'{"t": "fd", "size": 10}'), close=False, fds=fds)

    async def recover(reason: str) -> bool:
        return False

    runtime = AgentRuntime("sb-fake", "/workspace", path, provider_name="docker",
                           recover=recover)
    started = time.monotonic()
    with pytest.raises(hutch.ProviderError):
        await runtime.read_file("/workspace/x", 100)
    assert time.monotonic() - started < 6
    os.close(pipe_r)
    os.close(pipe_w)


async def test_what_the_agent_sent_before_it_hung_up_is_read_after_a_send_fails() -> None:
    # A command that exits without reading its stdin: the agent sends its
    # output and exit, and hangs up with the stdin frames unread. The feeder's
    # next send fails (EPIPE); the reader must still get the exit, not a
    # connection broken under it (the send used to close the connection and
    # throw the queued answer away: EBADF for the reader).
    ours, agents = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    channel = Channel(ours)
    await channel.send({"t": "in"}, b"stdin the command never reads")
    agents.sendall(_frame(b'{"t": "out", "s": 1}', b"kept") + _frame(b'{"t": "exit", "code": 0}'))
    agents.close()  # with the stdin frame unread
    with pytest.raises(AgentFailure, match="broke"):
        await channel.send({"t": "eof"})
    assert await channel.recv(5) == ({"t": "out", "s": 1}, b"kept")
    assert await channel.recv(5) == ({"t": "exit", "code": 0}, b"")
    assert not channel.usable  # open, but never kept for another request
    with pytest.raises(AgentFailure):
        await channel.recv(5)  # then the end, as an error: nothing hangs
    channel.close()
    with pytest.raises(AgentFailure, match="closed"):
        await channel.send({"t": "eof"})


async def test_a_link_planted_at_the_socket_is_refused(fake_agent_dir: str) -> None:
    target = os.path.join(fake_agent_dir, "elsewhere.sock")
    _FakeAgent(target, _frame(b'{"t": "ok"}'), close=False)
    link = os.path.join(fake_agent_dir, "agent.sock")
    os.symlink(target, link)
    with pytest.raises(AgentFailure):
        connect_socket(link)
    connect_socket(target).close()  # the socket itself is fine


@pytest.mark.docker
async def test_processes_inside_cannot_use_the_agent(sb: Any) -> None:
    # Root inside reaches the socket file, but the agent hangs up on any
    # peer in the sandbox; another user cannot even reach the file.
    probe = (
        "import socket, struct\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.connect('/.hutch/run/agent.sock')\n"
        "h = b'{\"op\": \"ping\"}'\n"
        "try:\n"
        "    s.sendall(struct.pack('>II', len(h), 0) + h)\n"
        "    answer = s.recv(100)\n"
        "except OSError:\n"
        "    answer = b''\n"
        "print(repr(answer))\n"
    )
    as_root = await sb.exec(["python3", "-c", probe])
    assert as_root.stdout.strip() == "b''", as_root
    as_nobody = await sb.exec(["python3", "-c", probe], user="nobody")
    assert as_nobody.exit_code != 0
    assert "Permission denied" in as_nobody.stderr


@pytest.mark.docker
async def test_the_image_user_is_the_default_and_root_is_asked_for() -> None:
    api = docker.APIClient()
    image = "hutch-test-user:bookworm"
    # An image whose USER is nobody: commands run as nobody unless told.
    container = api.create_container(TEST_IMAGE, command=["true"])
    try:
        api.commit(container["Id"], repository="hutch-test-user", tag="bookworm",
                   conf={"User": "nobody"})
    finally:
        api.remove_container(container["Id"], force=True)
    try:
        async with await hutch.create_sandbox("docker", image=image, runtime="agent") as sb:
            assert (await sb.exec(["id", "-un"])).stdout.strip() == "nobody"
            assert (await sb.exec(["id", "-un"], user="root")).stdout.strip() == "root"
            await sb.suspend()
            await sb.resume()
            assert (await sb.exec(["id", "-un"])).stdout.strip() == "nobody"
    finally:
        # Each run's commit would leave the one before it untagged behind.
        api.remove_image(image)


# -- adoption -------------------------------------------------------------------------------


@pytest.mark.docker
async def test_a_reconnected_backend_gets_its_agent_back(sb: Any) -> None:
    from hutch.providers.docker import DockerSandbox

    await sb.write_text("a.txt", "before")
    again = await DockerSandbox.reconnect(sb.id, backend_of(sb).describe())
    assert again.sandbox_capabilities().runtime == "agent"
    assert await again.runtime.read_file("/workspace/a.txt", 100) == b"before"
    assert await again.runtime.count_busy_processes() == 0


@pytest.mark.docker
def test_a_daemon_crash_adopts_the_sandbox_and_its_runtime(docker_runtime: str) -> None:
    # (Commands the crashed daemon started are ended at adoption: see
    # tests of owned processes. The sandbox, its files and its keeper stay.)
    from tests.daemon_fixture import DaemonProcess

    daemon = DaemonProcess().start()
    try:
        with hutch.Client(daemon.url, token=daemon.token) as c:
            sb = c.create_sandbox("docker", image=TEST_IMAGE, runtime=docker_runtime)
            assert sb.capabilities.runtime == docker_runtime
            sb.write_text("/root/kept.txt", "kept")
            keeper = sb.exec(["sh", "-c", "cat /proc/1/stat | cut -d' ' -f22"]).stdout
        daemon.restart()  # SIGKILL, then start: the container and its keeper live on
        with hutch.Client(daemon.url, token=daemon.token) as c:
            sb = c.get_sandbox(sb.id)
            assert sb.capabilities.runtime == docker_runtime
            assert sb.read_text("/root/kept.txt") == "kept"
            # The same keeper (its start time), not a new container.
            assert sb.exec(["sh", "-c", "cat /proc/1/stat | cut -d' ' -f22"]).stdout == keeper
            sb.suspend()
            sb.resume()  # a new container, its own agent
            assert sb.capabilities.runtime == docker_runtime
            assert sb.exec(["cat", "/root/kept.txt"]).stdout == "kept"
            sb.close()
    finally:
        daemon.stop()


@pytest.mark.docker
async def test_a_socket_planted_by_the_sandbox_is_never_reached(sb: Any) -> None:
    # Root inside replaces the agent's socket with a listener of its own; hutch
    # keeps talking to the agent, through its link made before anything ran.
    fake = (
        "import os, socket\n"
        "os.unlink('/.hutch/run/agent.sock')\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.bind('/.hutch/run/agent.sock')\n"
        "s.listen(8)\n"
        "open('/tmp/listening', 'w').close()\n"
        "while True:\n"
        "    c, _ = s.accept()\n"
        "    open('/tmp/fake-reached', 'w').close()\n"
        "    c.close()\n"
    )
    await sb.write_text("/tmp/fake.py", fake)
    await sb.exec("nohup python3 /tmp/fake.py >/dev/null 2>&1 &")
    await eventually(lambda: sb.exists("/tmp/listening"), within=10)
    for _ in range(5):
        assert (await sb.exec(["echo", "the real agent"])).stdout == "the real agent\n"
    assert not await sb.exists("/tmp/fake-reached")


# -- the workload's cgroup: room of the agent's own ---------------------------------------



def _cgroups_of(text: str) -> dict[str, str]:
    """/proc/PID/cgroup as controller -> path."""
    rows = (line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2)
    return {controllers: path for _, controllers, path in rows}


@pytest.mark.docker
async def test_commands_run_in_a_workload_cgroup_they_cannot_leave() -> None:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="agent", pids_limit=50, memory="200m",
        read_before_write=False,
    ) as sb:
        container = backend_of(sb).container_id
        # The caller's limits hold the workload; the container's leave the agent room.
        base = f"/sys/fs/cgroup/pids/docker/{container}"
        with open(f"{base}/pids.max") as fh:
            assert int(fh.read()) > 50
        with open(f"{base}/hutch-workload/pids.max") as fh:
            assert int(fh.read()) == 50
        with open(f"/sys/fs/cgroup/memory/docker/{container}/hutch-workload/"
                  "memory.limit_in_bytes") as fh:
            assert int(fh.read()) == 200 << 20
        for user in (None, "nobody"):
            mine = _cgroups_of((await sb.exec(["cat", "/proc/self/cgroup"], user=user)).stdout)
            assert mine["pids"].endswith("/hutch-workload"), mine
            assert mine["memory"].endswith("/hutch-workload"), mine
            assert not mine["freezer"].endswith("/hutch-workload"), mine  # pause holds it all
        pid = await agent_pid(sb)
        agents = _cgroups_of(await sb.read_text(f"/proc/{pid}/cgroup"))
        assert not agents["pids"].endswith("/hutch-workload"), agents
        # No way out, as root: the cgroup files are read-only, the agent holds
        # no descriptor of them, and no capability mounts another view.
        escape = await sb.exec(["sh", "-c",
                                "echo $$ > /sys/fs/cgroup/pids/cgroup.procs; "
                                "echo $$ > /sys/fs/cgroup/pids/tasks; "
                                "echo 100000 > /sys/fs/cgroup/pids/hutch-workload/pids.max; "
                                "mkdir /tmp/cg && mount -t cgroup -o pids none /tmp/cg; "
                                f"ls -l /proc/{pid}/fd; cat /proc/self/cgroup"])
        assert "cgroup.procs" not in escape.stdout and "tasks" not in escape.stdout
        assert _cgroups_of(escape.stdout)["pids"].endswith("/hutch-workload"), escape
        with open(f"{base}/hutch-workload/pids.max") as fh:
            assert int(fh.read()) == 50
        # A restarted agent (a new container cgroup) places the workload again.
        with pytest.raises(hutch.HutchError):
            await sb.exec(["sh", "-c", f"kill -9 {pid}; sleep 30"])

        async def placed_again() -> bool:
            text = (await sb.exec(["cat", "/proc/self/cgroup"])).stdout
            return _cgroups_of(text)["pids"].endswith("/hutch-workload")

        await eventually(placed_again, within=10)


@pytest.mark.docker
async def test_a_fork_bomb_leaves_the_agent_room_to_answer() -> None:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="agent", pids_limit=40, read_before_write=False,
    ) as sb:
        bomb, said = await fill_with_processes(sb)
        try:
            assert 10 < int(said.split("forked")[1].split()[0]) < 40
            # The workload is full, the agent is not: it answers files, the
            # busy count, and says why a new command cannot start.
            # Many at once: the agent needs threads of its own for them.
            runtime = backend_of(sb).runtime
            for _ in range(5):
                answers = await asyncio.gather(
                    *(sb.read_text("/etc/os-release") for _ in range(16)),
                    *(sb.list_dir("/usr/lib") for _ in range(16)),
                    *(runtime.count_busy_processes() for _ in range(8)),
                )
                assert all(answers) and min(answers[-8:]) >= 10
            with pytest.raises(hutch.HutchError) as info:
                await sb.exec(["echo", "no room"])
            assert "temporarily unavailable" in str(info.value), info.value
        finally:
            await bomb.kill()
        assert (await sb.exec(["echo", "room again"])).stdout == "room again\n"
        pid = await agent_pid(sb)
        assert await sb.exec(["true"]) and await agent_pid(sb) == pid  # the same agent


@pytest.mark.docker
async def test_busy_loops_share_the_cpu_as_one_beside_the_agent() -> None:
    # 50 busy loops once left the agent 1/51 of the container's CPU (every
    # request waited behind them); in a cpu cgroup of their own, below the
    # container's, they weigh as one against the agent's threads, and the
    # container's CPU limit still holds them all.
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="agent", cpus=1.0, read_before_write=False,
    ) as sb:
        container = backend_of(sb).container_id
        base = f"/sys/fs/cgroup/cpu/docker/{container}"
        with open(f"{base}/cpu.cfs_quota_us") as fh:
            assert int(fh.read()) == 100_000  # the container's limit, above the workload
        await answers_beside_busy_loops(sb, await agent_pid(sb))
        # A suspend removes the container (its cgroups, the workload's below
        # them included); the resumed one's agent places the workload again.
        await sb.suspend()
        assert not os.path.exists(base)
        await sb.resume()
        container = backend_of(sb).container_id
        base = f"/sys/fs/cgroup/cpu/docker/{container}"
        mine = cpu_cgroup((await sb.exec(["cat", "/proc/self/cgroup"])).stdout)
        assert mine == f"/docker/{container}/hutch-workload", mine
    assert not os.path.exists(base)


@pytest.mark.docker
async def test_an_exec_connection_serves_the_next_request(sb: Any) -> None:
    # A command's connection goes back to the pool once it has exited: a
    # run of execs opens no new connection to the agent per call.
    pid = await agent_pid(sb)
    listing = ["sh", "-c", f"ls -l /proc/{pid}/fd | grep -o 'socket:\\[[0-9]*\\]' | sort"]

    async def sockets() -> set[str]:
        return set((await sb.exec(listing)).stdout.split())

    for _ in range(3):
        await sb.exec(["true"])
    before = await sockets()
    for _ in range(20):
        assert (await sb.exec(["echo", "hi"])).stdout == "hi\n"
    assert await sb.exec(["sh", "-c", "exit 3"]) and (await sb.read_text("/etc/os-release"))
    assert len((await sockets()) - before) <= 2
