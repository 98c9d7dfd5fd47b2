"""When a command's end answers (its exec's timeout, a background command's
kill, a stream closed early), the command's whole process tree is gone: no
process of it remains, not even a zombie, to hold the sandbox's pids,
memory or files. Its tree here has many children, some ignoring SIGTERM,
one in a session of its own.

The tree's processes are found from the host, by name (their ``comm``,
which a zombie keeps): every process of it runs a copy of bash or sleep
named after the test: on local and ssh (this host, through sshd on
loopback), docker and bubblewrap (both runtimes) and kubernetes (the stand-in's
pods are docker containers on this host). Not gvisor: its processes are
runsc's on the host, not named as the command's (it runs hutch's agent, whose
kill the agent kinds here test).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

import hutch
from hutch._errors import KillIncomplete, ProviderError
from hutch.providers._proctree import ProcessTree
from hutch.providers.agent import process as agent_process
from hutch.providers.agent.runtime import AgentRuntime
from hutch.providers.agent.wire import EXEC_SILENCE_TIMEOUT
from hutch.providers.ssh import process as ssh_process
from tests import isolating
from tests.daemon_fixture import DaemonProcess, cleaned_daemon, client  # noqa: F401 - cleaned_daemon is the daemon fixture
from tests.hostprocs import named
from tests.isolating import kube_standin  # noqa: F401  (a fixture)
from tests.ssh_server import ALIAS, shared_server

#: local and ssh (its host is this one, through sshd on loopback) beside the isolating kinds.
KINDS = ["local", "ssh", *isolating.params("docker-agent", "docker-native", "bubblewrap-agent",
                                           "bubblewrap-native", "kubernetes"),
         # kubernetes on its native runtime too (pods/exec, no agent): a kind of this file's.
         "kubernetes-native"]

#: The processes the tree's script starts, beside itself: 6 subshells
#: ignoring SIGTERM with two sleeps each, 6 sleeps, a session of its own
#: (bash ignoring SIGTERM and its two sleeps), its last sleep.
TREE_SIZE = 1 + 6 * 3 + 6 + 3 + 1
TREE = """\
for i in 1 2 3 4 5 6; do
  ( trap "" TERM; ./{tag}b 1000 & ./{tag}b 1000 ) &
done
for i in 1 2 3 4 5 6; do ./{tag}b 1000 & done
setsid ./{tag}a -c 'trap "" TERM; ./{tag}b 1000 & ./{tag}b 1000' &
./{tag}b 1000
"""


def remaining(kind: str, tag: str) -> list[tuple[int, str, int]]:
    """What is left of the tree. On local, a zombie adopted by the host's
    PID 1 is left out: the local (and ssh) provider's orphans are the host's, and this
    host's init (a container's) may never reap them; they hold no memory nor
    files, and no sandbox limit."""
    return [p for p in named(tag)
            if not (kind in ("local", "ssh") and p[1] == "Z" and p[2] == 1)]


@pytest.fixture
async def sandbox(request: pytest.FixtureRequest) -> AsyncIterator[hutch.Sandbox]:
    kind = request.param
    if kind == "local":
        workdir = tempfile.mkdtemp(prefix="hutch-reap-")
        async with await hutch.create_sandbox("local", workdir=workdir) as sb:
            yield sb
        shutil.rmtree(workdir, ignore_errors=True)
    elif kind == "ssh":
        workdir = tempfile.mkdtemp(prefix="hutch-reap-")
        async with await hutch.create_sandbox(
            "ssh", working_directory=workdir, read_before_write=False, destination=ALIAS,
            config_file=shared_server().config_file,
        ) as sb:
            yield sb
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        standin = (request.getfixturevalue("kube_standin") if kind.startswith("kubernetes")
                   else None)
        extra = {"pids_limit": 256} if standin is None else (
            {"runtime": "native"} if kind == "kubernetes-native" else {})
        async with await hutch.create_sandbox(
            **isolating.settings(kind.removesuffix("-native") if standin else kind, standin,
                                 **extra),
            read_before_write=False
        ) as sb:
            yield sb


def _tree(name: str) -> tuple[str, str, str]:
    """(tag, the tree's script, the command that runs it from ``name``)."""
    tag = "rp" + uuid.uuid4().hex[:8]
    return tag, TREE.format(tag=tag), (
        f'cp "$(command -v bash)" ./{tag}a && cp "$(command -v sleep)" ./{tag}b '
        f"&& exec ./{tag}a ./{name}")


async def _tree_command(sb: hutch.Sandbox) -> tuple[str, str]:
    """(tag, the command that runs the tree)."""
    tag, script, command = _tree("tree.sh")
    await sb.write_text("tree.sh", script)
    return tag, command


def _grown(tag: str) -> int:
    """Wait (the thread) for the whole tree to be up; how many processes it had."""
    deadline = time.monotonic() + 60
    while (seen := len([p for p in named(tag) if p[1] != "Z"])) < TREE_SIZE:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return seen


async def _until_grown(tag: str) -> int:
    """Wait for the whole tree to be up; how many processes it had."""
    seen = 0
    with anyio.move_on_after(60):
        while True:
            seen = len([p for p in named(tag) if p[1] != "Z"])
            if seen >= TREE_SIZE:
                break
            await anyio.sleep(0.05)
    return seen


async def _what_became_of(
    sb: hutch.Sandbox, process: Any | None, stream: AsyncIterator[Any] | None
) -> str:
    """For a tree that did not grow: what its command said and how it ended
    (within a few seconds), and what the sandbox runs."""
    said: list[str] = []
    try:
        with anyio.move_on_after(5):
            if process is not None:
                said.append(repr(await process.wait()))
            elif stream is not None:
                async for event in stream:
                    said.append(repr(event))
    except Exception as exc:  # how it ended is what is asked
        said.append(f"it raised {exc!r}")
    try:
        with anyio.move_on_after(10):
            listing = await sb.exec("ps -eo pid,stat,comm,args 2>&1 || ls /proc")
            said.append(f"the sandbox runs: {listing.stdout}")
    except Exception as exc:
        said.append(f"the sandbox could not list its processes: {exc!r}")
    return "; ".join(said) or "nothing said"


async def _grown_or_explained(
    tag: str, sb: hutch.Sandbox, process: Any | None, stream: AsyncIterator[Any] | None
) -> None:
    """Wait for the whole tree of ``process`` (or ``stream``'s command) to be up;
    a tree that does not grow fails the test with what became of its command."""
    grown = await _until_grown(tag)
    if grown < TREE_SIZE:
        pytest.fail(f"the tree grew to {grown} of {TREE_SIZE} processes; "
                    + await _what_became_of(sb, process, stream))


parametrized = pytest.mark.parametrize("sandbox", KINDS, indirect=True)


@pytest.mark.anyio
@pytest.mark.docker
@parametrized
async def test_an_exec_timeout_answers_once_its_tree_is_gone(
    sandbox: hutch.Sandbox, request: Any
) -> None:
    kind = request.node.callspec.params["sandbox"]
    tag, command = await _tree_command(sandbox)
    grown = 0
    timed_out = False

    async def watch() -> None:
        nonlocal grown
        grown = await _until_grown(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            await sandbox.exec(command, timeout=8)
        except hutch.ExecTimeout:
            timed_out = True
            left = remaining(kind, tag)
    assert timed_out
    assert grown >= TREE_SIZE, grown
    assert left == [], left


@pytest.mark.anyio
@pytest.mark.docker
@parametrized
@pytest.mark.parametrize("leader", ["running", "ended"])
async def test_a_killed_background_command_is_gone_when_its_kill_returns(
    sandbox: hutch.Sandbox, request: Any, leader: str
) -> None:
    kind = request.node.callspec.params["sandbox"]
    tag, command = await _tree_command(sandbox)
    if leader == "ended":  # its shell exits at once; the tree holds its output open
        command = f"({command}) & exit 0"
    process = await sandbox.start(command)
    await _grown_or_explained(tag, sandbox, process, None)
    await process.kill()
    assert remaining(kind, tag) == []


@pytest.mark.anyio
@pytest.mark.docker
@parametrized
async def test_a_stream_closed_early_ends_once_its_tree_is_gone(
    sandbox: hutch.Sandbox, request: Any
) -> None:
    kind = request.node.callspec.params["sandbox"]
    tag, command = await _tree_command(sandbox)
    stream = sandbox.exec_stream(f"echo up; {command}")
    try:
        async for _event in stream:  # its first output: the tree is starting
            break
        await _grown_or_explained(tag, sandbox, None, stream)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert remaining(kind, tag) == []


@pytest.mark.docker
@pytest.mark.parametrize("kind", isolating.params("docker-agent", "docker-native",
                                                  "bubblewrap-agent", "bubblewrap-native"))
def test_through_the_daemon_a_timeout_or_a_caller_gone_ends_the_whole_tree(
    daemon: DaemonProcess, kind: str
) -> None:
    with client(daemon) as c:
        sb = c.create_sandbox(**isolating.settings(kind, pids_limit=256),
                              read_before_write=False)
        try:
            # The daemon's answer to a timed-out exec comes once the tree is gone.
            tag, script, command = _tree("timed.sh")
            sb.write_text("timed.sh", script)
            grown: list[int] = []
            watcher = threading.Thread(target=lambda: grown.append(_grown(tag)))
            watcher.start()
            try:
                with pytest.raises(hutch.ExecTimeout):
                    sb.exec(command, timeout=8)
                left = remaining(kind, tag)
            finally:
                watcher.join()
            assert grown[0] >= TREE_SIZE, grown
            assert left == [], left

            # A caller that goes away mid-stream: the daemon kills the tree,
            # and all of it goes (nothing left to the host's init, say).
            tag, script, command = _tree("streamed.sh")
            sb.write_text("streamed.sh", script)
            with httpx.stream(
                "POST", f"{daemon.url}/v1/sandboxes/{sb.id}/exec/stream",
                json={"cmd": f"echo up; {command}"},
                headers={"Authorization": f"Bearer {daemon.token}"}, timeout=60,
            ) as answer:
                assert answer.status_code == 200
                lines = answer.iter_lines()
                assert "stream" in json.loads(next(lines))
                # (``lines`` is kept: dropped, its iterator would close the answer)
                assert _grown(tag) >= TREE_SIZE
            deadline = time.monotonic() + 60
            while (left := remaining(kind, tag)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert left == [], left
        finally:
            c.delete_sandbox(sb.id)


@pytest.mark.anyio
async def test_a_tree_that_cannot_be_reaped_is_said_not_waited_for() -> None:
    """A process the kernel holds (here: frozen in a freezer cgroup of the
    test's own, which no kill thaws) outlives its SIGKILL: the kill says so,
    typed, once its bound has passed, instead of waiting on."""
    if not os.path.isdir("/sys/fs/cgroup/freezer") or os.geteuid() != 0:
        pytest.skip("needs cgroup v1's freezer, as root")
    freezer = f"/sys/fs/cgroup/freezer/hutch-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(freezer)
    marker = f"HUTCH_EXEC_ID={uuid.uuid4().hex}"
    held = await anyio.open_process(
        ["sleep", "1000"], env={**os.environ, "HUTCH_EXEC_ID": marker.split("=", 1)[1]})
    try:
        with open(f"{freezer}/cgroup.procs", "w") as fh:
            fh.write(str(held.pid))
        with open(f"{freezer}/freezer.state", "w") as fh:
            fh.write("FROZEN")
        with pytest.raises(KillIncomplete, match="outlived its kill"):
            await ProcessTree(marker).kill(0, bound=1)
    finally:
        with open(f"{freezer}/freezer.state", "w") as fh:
            fh.write("THAWED")
        held.kill()
        await held.wait()
        os.rmdir(freezer)


def _agents_of(sandbox_id: str) -> list[int]:
    """The host pids of the sandbox's agent (its environment names the sandbox)."""
    needle = f"HUTCH_SANDBOX_ID={sandbox_id}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/comm", "rb") as fh:
                if fh.read().strip() != b"hutch-agent":
                    continue
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


async def _exec_raising_into(sandbox: hutch.Sandbox, command: str,
                             outcome: list[BaseException]) -> None:
    """Run ``command`` with a 4 s timeout; what it raises goes into ``outcome``
    (it is the subject of the test that reads it)."""
    try:
        await sandbox.exec(command, timeout=4)
    except BaseException as exc:
        outcome.append(exc)


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("sandbox", isolating.params("docker-agent", "bubblewrap-agent"),
                         indirect=True)
async def test_a_kill_its_agent_never_confirms_is_not_said_done(
    sandbox: hutch.Sandbox, request: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent answers a kill once the tree is gone. An agent that does not
    answer (here: stopped from the host) has killed nothing: the timed-out
    exec says so (KillIncomplete) while the tree lives on, or says it was
    killed only once it is gone (docker restarts a wedged agent's container,
    which ends every process in it)."""
    # A stopped agent never answers: its bounds, shortened, only end the wait sooner.
    monkeypatch.setattr(agent_process, "REAP_SECONDS", 2.0)
    monkeypatch.setattr(agent_process, "ENDED_AFTER_KILL_SECONDS", 1.0)
    kind = request.node.callspec.params["sandbox"]
    agents = _agents_of(sandbox.id)
    assert agents
    tag, command = await _tree_command(sandbox)
    outcome: list[BaseException] = []

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_exec_raising_into, sandbox, command, outcome)
            assert await _until_grown(tag) >= TREE_SIZE
            for pid in agents:
                os.kill(pid, signal.SIGSTOP)
        # (Looked at before the agent goes on: it then does the kill it was sent.)
        left = [p for p in remaining(kind, tag) if p[1] != "Z"]
    finally:
        for pid in agents:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert len(outcome) == 1
    if isinstance(outcome[0], hutch.ExecTimeout):
        assert left == [], left  # "its whole process tree was killed"
    else:
        assert isinstance(outcome[0], KillIncomplete), repr(outcome[0])
        assert "did not confirm" in str(outcome[0])
        assert len(left) >= TREE_SIZE, left
    if kind.startswith("bubblewrap"):  # its agent runs on: nothing restarts it
        assert isinstance(outcome[0], KillIncomplete), repr(outcome[0])


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("sandbox", isolating.params("docker-agent", "bubblewrap-agent"),
                         indirect=True)
async def test_a_kill_its_agent_refuses_is_not_said_done(
    sandbox: hutch.Sandbox, request: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill request that fails (here: the agent's answer is an error, not
    its kill) in a sandbox that is not held has confirmed nothing: the
    timed-out exec says so (KillIncomplete) while the tree lives on, never
    that the tree was killed."""
    kind = request.node.callspec.params["sandbox"]
    original = AgentRuntime.request

    async def refusing(self: AgentRuntime, header: Any, parse: Any, **kw: Any) -> Any:
        if header.get("op") == "kill":
            raise ProviderError("the agent refused the kill (injected)")
        return await original(self, header, parse, **kw)

    tag, command = await _tree_command(sandbox)
    outcome: list[BaseException] = []
    monkeypatch.setattr(AgentRuntime, "request", refusing)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_exec_raising_into, sandbox, command, outcome)
        assert await _until_grown(tag) >= TREE_SIZE
    monkeypatch.undo()
    left = [p for p in remaining(kind, tag) if p[1] != "Z"]
    assert len(outcome) == 1
    if isinstance(outcome[0], hutch.ExecTimeout):
        assert left == [], left  # "its whole process tree was killed"
    else:
        assert isinstance(outcome[0], KillIncomplete), repr(outcome[0])
        assert "refused the kill" in str(outcome[0])
        assert len(left) >= TREE_SIZE, left


def _ancestor_named(pid: int, name: bytes) -> int | None:
    """The nearest ancestor of ``pid`` whose name is ``name``."""
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            return None
        pid = int(stat[stat.rindex(b")") + 2:].split()[1])
        try:
            with open(f"/proc/{pid}/comm", "rb") as fh:
                if fh.read().strip() == name:
                    return pid
        except OSError:
            return None
    return None


@pytest.mark.anyio
@pytest.mark.parametrize("sandbox", ["ssh"], indirect=True)
async def test_a_kill_the_ssh_host_never_answers_is_not_said_done(
    sandbox: hutch.Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kill runs on the host over the sandbox's connection; when that
    connection's server is stopped (here: its sshd process, from this host)
    no kill runs, and the timed-out exec says so (KillIncomplete) while the
    tree lives on, never that it was killed."""
    # A stopped sshd never answers: the bounds, shortened, only end the wait sooner.
    monkeypatch.setattr(ssh_process, "KILL_ANSWER_SECONDS", 3.0)
    monkeypatch.setattr(ssh_process, "CLOSED_AFTER_KILL_SECONDS", 1.0)
    tag, command = await _tree_command(sandbox)
    outcome: list[BaseException] = []

    server: int | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_exec_raising_into, sandbox, command, outcome)
            assert await _until_grown(tag) >= TREE_SIZE
            leader = min(p[0] for p in named(tag))
            server = _ancestor_named(leader, b"sshd")
            assert server is not None
            os.kill(server, signal.SIGSTOP)
        left = [p for p in remaining("ssh", tag) if p[1] != "Z"]
    finally:
        if server is not None:
            os.kill(server, signal.SIGCONT)
        for pid, _state, _parent in named(tag):  # what the kill never reached
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert len(outcome) == 1
    assert isinstance(outcome[0], KillIncomplete), repr(outcome[0])
    assert "may still be running" in str(outcome[0])
    assert len(left) >= TREE_SIZE, left


def _sigkill_pending(pid: int) -> bool:
    """Whether ``pid`` has a SIGKILL waiting (a frozen process holds one until its thaw)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        return True  # gone
    pending = int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)
    return bool(pending & (1 << (signal.SIGKILL - 1)))


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("sandbox", isolating.params("docker-agent", "bubblewrap-agent",
                                                     "docker-native", "bubblewrap-native"),
                         indirect=True)
@pytest.mark.parametrize("how", ["kill", "stream"])
async def test_a_kill_in_a_paused_sandbox_dooms_the_tree_before_it_answers(
    sandbox: hutch.Sandbox, request: Any, how: str
) -> None:
    """A paused sandbox's processes cannot end until it resumes, nor can its
    agent answer; a kill of one of its commands (a background command's, a
    stream closed early) answers with every process of the tree gone or
    holding a SIGKILL (it dies at the thaw, before running again), and the
    tree is gone once the sandbox resumes."""
    kind = request.node.callspec.params["sandbox"]
    tag, command = await _tree_command(sandbox)
    process = None
    stream = None
    if how == "kill":
        process = await sandbox.start(command)
    else:
        stream = sandbox.exec_stream(f"echo up; {command}")
        async for _event in stream:  # its first output: the tree is starting
            break
    await _grown_or_explained(tag, sandbox, process, stream)
    paused = False
    try:
        await sandbox.pause()
        paused = True
        if process is not None:
            await process.kill()
            # Its end is the SIGKILL's, told now: nothing of it runs again.
            assert (process.running, process.exit_code) == (False, 128 + 9)
        else:
            assert stream is not None
            await stream.aclose()  # type: ignore[attr-defined]
        alive = [p for p in remaining(kind, tag) if p[1] not in ("Z", "X")]
        doomed = [p for p in alive if _sigkill_pending(p[0])]
        # Told while the sandbox is still paused: no command of it is left running.
        assert [p.exit_code for p in sandbox.processes() if p.running] == []
    finally:
        if paused:
            await sandbox.resume()
    assert alive == doomed, [p for p in alive if p not in doomed]
    with anyio.move_on_after(30):  # the thaw: each ends, and is reaped
        while True:
            if not remaining(kind, tag):
                break
            await anyio.sleep(0.05)
    assert remaining(kind, tag) == []


@pytest.mark.docker
@pytest.mark.parametrize("kind", isolating.params("bubblewrap-agent"))
def test_a_kill_that_left_processes_is_an_event_of_its_sandbox(
    daemon: DaemonProcess, kind: str
) -> None:
    """A KillIncomplete is told to its caller and recorded in the sandbox's
    events (``hutch events``), as an OOM kill is: here an agent stopped from
    the host confirms no kill (its sandbox is not restarted: bubblewrap)."""
    with client(daemon) as c:
        sb = c.create_sandbox(**isolating.settings(kind), read_before_write=False)
        agents = _agents_of(sb.id)
        assert agents
        try:
            tag = "rp" + uuid.uuid4().hex[:8]
            outcome: list[BaseException] = []

            def timed_out() -> None:
                try:
                    sb.exec(f'cp "$(command -v sleep)" ./{tag} && exec ./{tag} 1000', timeout=4)
                except BaseException as exc:  # what it raised is the subject
                    outcome.append(exc)

            runner = threading.Thread(target=timed_out)
            runner.start()
            try:
                deadline = time.monotonic() + 60
                while not named(tag) and time.monotonic() < deadline:
                    time.sleep(0.05)
                for pid in agents:
                    os.kill(pid, signal.SIGSTOP)
                runner.join()
            finally:
                for pid in agents:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            # (KillIncomplete travels as provider_error)
            assert len(outcome) == 1 and isinstance(outcome[0], hutch.ProviderError), outcome
            assert "did not confirm" in str(outcome[0])
            kills = [e for e in c.events(sb.id) if e["kind"] == "kill"]
            assert [e["message"] for e in kills] == [outcome[0].message], kills
        finally:
            c.delete_sandbox(sb.id)


async def _inside(sandbox: hutch.Sandbox, tag: str) -> int:
    """How many processes named ``tag`` the sandbox's own /proc shows alive."""
    result = await sandbox.exec(
        f"n=0; for s in /proc/[0-9]*/stat; do read -r line < $s 2>/dev/null || continue; "
        f'case "$line" in *"({tag}) Z"*) ;; *"({tag}) "*) n=$((n+1));; esac; done; echo $n')
    return int(result.stdout.strip())


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("sandbox", isolating.params("gvisor"), indirect=True)
async def test_a_kill_in_a_paused_gvisor_sandbox_is_said_not_done_and_done_at_resume(
    sandbox: hutch.Sandbox,
) -> None:
    """gVisor's processes are its own kernel's, not this host's: a kill in a
    paused sandbox cannot be sent from here, and its agent cannot act until
    the sandbox resumes. The kill says so (KillIncomplete), not that it is
    done, and its agent ends the tree once the sandbox resumes."""
    tag = "rp" + uuid.uuid4().hex[:8]
    process = await sandbox.start(
        f'cp "$(command -v sleep)" ./{tag} && (./{tag} 1000 & ./{tag} 1000)')
    with anyio.move_on_after(60):
        while True:
            if await _inside(sandbox, tag) >= 2:
                break
            await anyio.sleep(0.1)
    assert await _inside(sandbox, tag) == 2
    await sandbox.pause()
    try:
        with pytest.raises(KillIncomplete, match="paused"):
            await process.kill()
    finally:
        await sandbox.resume()
    with anyio.move_on_after(30):
        while True:
            if await _inside(sandbox, tag) == 0:
                break
            await anyio.sleep(0.1)
    assert await _inside(sandbox, tag) == 0


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("sandbox", isolating.params("docker-agent", "bubblewrap-agent",
                                                     "gvisor"), indirect=True)
async def test_a_background_command_lives_through_a_long_pause(sandbox: hutch.Sandbox) -> None:
    """A paused sandbox's agent is silent (frozen) for as long as the pause
    lasts, past the bound its running commands' silence is allowed: the
    command is held, not lost, nor killed; it runs on at the resume."""
    tag = "rp" + uuid.uuid4().hex[:8]
    process = await sandbox.start(
        f'cp "$(command -v sleep)" ./{tag} && ./{tag} 1000 & wait; echo ended')
    with anyio.move_on_after(60):
        while True:
            if await _inside(sandbox, tag) >= 1:
                break
            await anyio.sleep(0.1)
    await sandbox.pause()
    try:
        await anyio.sleep(EXEC_SILENCE_TIMEOUT + 2)
    finally:
        await sandbox.resume()
    assert await _inside(sandbox, tag) == 1
    assert process.running
    await process.kill()
