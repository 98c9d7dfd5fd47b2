"""The gvisor provider: what runsc adds beyond the conformance suite (which
runs every case its capabilities declare): processes that live through a
suspend, and checkpoints tied to the runsc build that wrote them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import hutch
from hutch._errors import ProviderError
from hutch._sandbox import backend_of
from hutch.providers.gvisor.checkpoints import META, CheckpointBuildMismatch
from hutch.providers.gvisor.runsc import complete, list_ids
from hutch.providers.gvisor.runsc import state as runsc_state
from hutch.providers.gvisor.sandbox import GvisorSandbox, snapshots_dir
from tests.conftest import TEST_IMAGE

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.docker,
    pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed"),
]

COUNTER = (
    # Renamed into place: a reader never sees the file half written.
    "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; "
    "mv /tmp/count.new /tmp/count; sleep 0.05; done' "
    ">/dev/null 2>&1 & echo $! > /tmp/counter.pid"
)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def sandbox() -> AsyncIterator[Any]:
    async with await hutch.create_sandbox(
        "gvisor", image=TEST_IMAGE, read_before_write=False
    ) as sb:
        yield sb


async def _counter(sb: Any) -> tuple[str, int]:
    result = await sb.exec("cat /tmp/counter.pid; cat /tmp/count")
    pid, count = result.stdout.split()
    return pid, int(count)


async def test_a_process_holding_state_in_memory_survives_suspend_with_its_pid(
    sandbox: Any,
) -> None:
    await sandbox.exec(COUNTER)
    # Memory only the process holds: a shell variable, and a file in /tmp
    # (the sandbox's tmpfs) that only it writes.
    await sandbox.exec("sleep 0.3")
    pid, before = await _counter(sandbox)
    for _ in range(3):
        await sandbox.suspend()
        assert (await backend_of(sandbox).observed_state()).name == "SUSPENDED"
        await sandbox.resume()
        await sandbox.exec("sleep 0.2")
        now_pid, now = await _counter(sandbox)
        assert now_pid == pid
        assert now > before  # it went on counting from where it was, not from 0
        before = now
    alive = await sandbox.exec(["kill", "-0", pid])
    assert alive.exit_code == 0


async def test_a_suspend_answers_once_the_sandbox_process_has_ended(sandbox: Any) -> None:
    # runsc answers a checkpoint once its image is written; the sandbox
    # process (holding the memory) ends a little later. The suspend's
    # answer waits for that: its memory is freed when it says so.
    backend = backend_of(sandbox)
    for _ in range(3):
        found_state = runsc_state(backend.container)
        assert found_state is not None
        pid = int(found_state["pid"])
        await sandbox.suspend()
        try:
            with open(f"/proc/{pid}/stat") as found:
                stat = found.read()
            state = stat[stat.rindex(")") + 2]
        except (FileNotFoundError, ProcessLookupError):  # reaped, also while read
            state = "gone"
        assert state in ("Z", "X", "gone")
        await sandbox.resume()


async def test_files_written_before_a_suspend_are_there_after(sandbox: Any) -> None:
    await sandbox.write_text("kept.txt", "in the memory overlay")
    await sandbox.suspend()
    await sandbox.resume()
    assert await sandbox.read_text("kept.txt") == "in the memory overlay"


async def test_a_checkpoint_of_another_runsc_build_is_refused(sandbox: Any) -> None:
    backend = backend_of(sandbox)
    await sandbox.suspend()
    meta = os.path.join(backend.checkpoint_dir, META)
    with open(meta) as found:
        recorded = json.load(found)
    with open(meta, "w") as out:
        json.dump({**recorded, "runsc_build": "runsc version release-20200101.0"}, out)
    try:
        with pytest.raises(CheckpointBuildMismatch, match="another runsc build"):
            await sandbox.resume()
    finally:
        with open(meta, "w") as out:
            json.dump(recorded, out)
    await sandbox.resume()
    assert (await sandbox.exec("echo back")).stdout == "back\n"


# -- processes that hold state in memory ------------------------------------------------

#: A process holding state only in memory: a counter, a buffer of known hash,
#: a child process, a loopback TCP connection to itself. Asked (a file
#: appears), it answers: its pid, count, the buffer's hash now and at the
#: start, its child's pid and state, and a message sent through its connection.
HOLDER = r"""
import hashlib, os, random, socket, subprocess, sys, time
buf = bytearray(random.Random(7).randbytes(int(sys.argv[1])))
known = hashlib.sha256(buf).hexdigest()
child = subprocess.Popen(["sh", "-c", "while :; do sleep 1; done"])
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
client = socket.create_connection(server.getsockname())
peer, _ = server.accept()
count = 0
with open("/tmp/holder.ready", "w") as ready:
    ready.write(str(os.getpid()))
while True:
    count += 1
    if os.path.exists("/tmp/ask"):
        os.unlink("/tmp/ask")
        client.sendall(b"through-%d" % count)
        got = peer.recv(100).decode()
        now = hashlib.sha256(buf).hexdigest()
        with open("/tmp/answer.tmp", "w") as out:
            out.write(f"{os.getpid()} {count} {now} {known} {child.pid} {child.poll()} {got}")
        os.rename("/tmp/answer.tmp", "/tmp/answer")
    time.sleep(0.02)
"""
ASK = ("rm -f /tmp/answer; touch /tmp/ask; i=0; "
       "while [ ! -f /tmp/answer ] && [ $i -lt 1500 ]; do sleep 0.02; i=$((i+1)); done; "
       "cat /tmp/answer")


async def _start_holder(sb: Any, size: int) -> str:
    await sb.write_text("/tmp/holder.py", HOLDER)
    await sb.exec(f"nohup python3 /tmp/holder.py {size} >/tmp/holder.log 2>&1 &")
    ready = await sb.exec("i=0; while [ ! -s /tmp/holder.ready ] && [ $i -lt 3000 ]; "
                          "do sleep 0.02; i=$((i+1)); done; cat /tmp/holder.ready", timeout=90)
    assert ready.stdout.strip(), (await sb.exec("cat /tmp/holder.log")).stdout
    return ready.stdout.strip()


async def _ask_holder(sb: Any) -> tuple[str, int, str, str, str]:
    said = (await sb.exec(ASK, timeout=60)).stdout.split()
    pid, count, now, known, child, child_status, got = said
    assert now == known  # the buffer is as it was written
    assert child_status == "None"  # the child still runs
    assert got == f"through-{count}"  # the connection carries on
    return pid, int(count), now, child, got


async def _state_survives(size: int, cycles: int) -> None:
    async with await hutch.create_sandbox(
        "gvisor", image=TEST_IMAGE, read_before_write=False
    ) as sb:
        pid = await _start_holder(sb, size)
        first_pid, before, digest, child, _ = await _ask_holder(sb)
        assert first_pid == pid
        for _ in range(cycles):
            await sb.suspend()
            await sb.resume()
            now_pid, count, now_digest, now_child, _ = await _ask_holder(sb)
            assert (now_pid, now_digest, now_child) == (pid, digest, child)
            assert count > before  # counting on from where it was, not again from 0
            before = count


async def test_state_in_memory_survives_20_suspend_resume_cycles() -> None:
    await _state_survives(1 << 20, 20)


async def test_a_200_mb_buffer_survives_suspend_resume_with_its_hash() -> None:
    await _state_survives(200 << 20, 2)


# -- pid 1 reaps ------------------------------------------------------------------------

async def test_orphans_are_reaped_also_across_a_suspend(sandbox: Any) -> None:
    # An orphan of a finished command, and a background process whose
    # parent ended: both come to pid 1, which must reap them (a `sleep` as
    # pid 1 left them as zombies). The suspend ends nothing in between.
    await sandbox.exec("sh -c '(sleep 0.2 &) ; exit 0'")
    await sandbox.exec("nohup sh -c 'sleep 0.6' >/dev/null 2>&1 &")
    await sandbox.suspend()
    await sandbox.resume()
    await sandbox.exec("sleep 1")
    listed = await sandbox.exec("ps -eo pid,ppid,stat,comm")
    zombies = [line for line in listed.stdout.splitlines()[1:] if line.split()[2].startswith("Z")]
    assert zombies == [], listed.stdout
    first = (await sandbox.exec("cat /proc/1/cmdline | tr '\\0' ' '")).stdout
    assert "hutch-agent" in first


# -- fork: the same process tree, going on in each branch -------------------------------

async def test_fork_into_3_branches_each_continues_the_process_tree_on_its_own() -> None:
    async with await hutch.create_sandbox(
        "gvisor", image=TEST_IMAGE, read_before_write=False
    ) as origin:
        await origin.exec(COUNTER)
        await origin.write_text("shared-before.txt", "from before the fork")
        await origin.exec("sleep 0.3")
        pid, at_fork = await _counter(origin)
        fork = await origin.fork(count=3)
        try:
            assert fork.snapshot.handle is not None and fork.snapshot.handle.includes_memory
            everyone = [origin, *fork.branches]
            assert len({sb.id for sb in everyone}) == 4
            for index, sb in enumerate(everyone):
                # Each has the same process, counting on from the fork.
                now_pid, count = await _counter(sb)
                assert now_pid == pid
                assert count >= at_fork
                assert await sb.read_text("shared-before.txt") == "from before the fork"
                await sb.write_text("mine.txt", f"written by {index}")
            for index, sb in enumerate(everyone):
                assert await sb.read_text("mine.txt") == f"written by {index}"
            # One branch's process ends: the others', and the origin's, go on.
            await fork.branches[0].exec(["kill", pid])
            await fork.branches[0].exec("sleep 0.2")
            gone = await fork.branches[0].exec(["kill", "-0", pid])
            assert gone.exit_code != 0
            for sb in [origin, *fork.branches[1:]]:
                _, before = await _counter(sb)
                await sb.exec("sleep 0.3")
                now_pid, after = await _counter(sb)
                assert now_pid == pid and after > before
            # Each branch suspends and resumes on its own, its process kept.
            await fork.branches[1].suspend()
            await fork.branches[1].resume()
            assert (await _counter(fork.branches[1]))[0] == pid
            assert await fork.branches[1].read_text("mine.txt") == "written by 2"
        finally:
            await fork.close()
        assert fork.snapshot.id not in await backend_of(origin).held_snapshots()
        assert not os.path.exists(os.path.join(snapshots_dir(), fork.snapshot.id))


# -- through the daemon: an idle suspend keeps an agent's processes ---------------------

SERVER = r"""
import os, socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", 8765))
server.listen(4)
open("/tmp/server.ready", "w").write(str(os.getpid()))
while True:
    conn, _ = server.accept()
    conn.sendall(b"server %d says %s" % (os.getpid(), conn.recv(100)))
    conn.close()
"""
CLIENT = ("python3 -c \"import socket; c = socket.create_connection(('127.0.0.1', 8765)); "
          "c.sendall(b'hello'); print(c.recv(200).decode())\"")


async def test_an_idle_suspend_through_the_daemon_keeps_a_background_server() -> None:
    from tests.conformance.remote import daemon

    d = daemon()
    async with hutch.AsyncClient(d.url, token=d.token) as client:
        sb = await client.create_sandbox(
            "gvisor", image=TEST_IMAGE, read_before_write=False, idle_suspend_after=1,
        )
        try:
            await sb.write_text("/tmp/server.py", SERVER)
            await sb.exec("nohup python3 /tmp/server.py >/tmp/server.log 2>&1 &")
            ready = await sb.exec("i=0; while [ ! -s /tmp/server.ready ] && [ $i -lt 1000 ]; "
                                  "do sleep 0.02; i=$((i+1)); done; cat /tmp/server.ready")
            pid = ready.stdout.strip()
            assert pid
            first = await sb.exec(CLIENT)
            assert first.stdout.strip() == f"server {pid} says hello"
            # Left alone, the daemon suspends it (its memory freed).
            for _ in range(300):
                if (await sb.status()).state.value == "suspended":
                    break
                await anyio.sleep(0.1)
            assert (await sb.status()).state.value == "suspended"
            # The next call resumes it: the same server answers.
            after = await sb.exec(CLIENT)
            assert after.stdout.strip() == f"server {pid} says hello"
        finally:
            await sb.close()


async def test_a_fork_through_the_daemon_starts_its_branches_together_each_its_own() -> None:
    # The daemon restores a gvisor fork's branches side by side: each is
    # made whole, with the process tree, and none sees another's writes.
    from tests.conformance.remote import daemon

    d = daemon()
    async with hutch.AsyncClient(d.url, token=d.token) as client:
        origin = await client.create_sandbox("gvisor", image=TEST_IMAGE, read_before_write=False)
        try:
            await origin.exec(COUNTER)
            await origin.exec("sleep 0.2")
            pid, _ = await _counter(origin)
            fork = await origin.fork("together", count=3)
            try:
                assert len({b.id for b in fork.branches}) == 3
                for index, branch in enumerate(fork.branches):
                    assert (await _counter(branch))[0] == pid
                    await branch.write_text("mine.txt", f"branch {index}")
                for index, branch in enumerate(fork.branches):
                    assert await branch.read_text("mine.txt") == f"branch {index}"
                assert not await origin.exists("mine.txt")
            finally:
                await fork.close()
        finally:
            await origin.close()


async def test_a_process_at_work_keeps_the_sandbox_awake_one_waiting_does_not() -> None:
    async with await hutch.create_sandbox(
        "gvisor", image=TEST_IMAGE, read_before_write=False, idle_suspend_after=1,
    ) as sb:
        await sb.exec("nohup sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $! > /tmp/busy")
        await anyio.sleep(3)  # three idle windows: each look finds it at work
        assert sb.status().state.value == "running"
        await sb.exec("kill $(cat /tmp/busy); nohup sleep 600 >/dev/null 2>&1 &")
        for _ in range(300):
            if sb.status().state.value == "suspended":
                break
            await anyio.sleep(0.1)
        assert sb.status().state.value == "suspended"
        assert (await sb.exec("pgrep -x sleep")).exit_code == 0  # it was kept


async def test_an_agent_told_to_let_go_from_inside_is_woken_by_the_next_call(
    sandbox: Any,
) -> None:
    # Root in the sandbox can signal its pid 1 (the agent), which then lets
    # go of its socket as before a checkpoint: hutch's next call wakes it.
    # The call that sends it, or the next one (on a kept connection the
    # agent closed meanwhile), may lose its connection with the rest; the
    # one after is served.
    for command in ("kill -USR1 1", "kill -USR1 1; kill -USR2 1; kill -USR1 1"):
        with contextlib.suppress(ProviderError):
            await sandbox.exec(command)
        with contextlib.suppress(ProviderError):
            await sandbox.exec("true")
        assert (await sandbox.exec("echo still here")).stdout == "still here\n"


async def test_each_restore_runs_under_a_new_container_which_a_restarted_daemon_finds(
    sandbox: Any,
) -> None:
    # A new runsc container id per restore: none waits for the stopped
    # sandbox before it to be gone (runsc refuses a name still in use).
    backend = backend_of(sandbox)
    stale = backend.describe()
    await sandbox.suspend()
    await sandbox.resume()
    assert backend.container != stale["container"]
    assert backend.describe()["container"] == backend.container
    # A daemon that died before it saved the new description finds the
    # container in the sandbox's record, not under the stopped one's id.
    again = await GvisorSandbox.reconnect(sandbox.id, stale)
    assert again.container == backend.container
    assert (await again.observed_state()).name == "RUNNING"
    # The stopped one's leftovers are removed, in the background: runsc
    # knows only the running container of this sandbox once it is done.
    for _ in range(300):
        if [c for c in list_ids() if sandbox.id in c] == [backend.container]:
            break
        await anyio.sleep(0.1)
    assert [c for c in list_ids() if sandbox.id in c] == [backend.container]
    # runsc takes a name it does not know as another's prefix: the stopped
    # one's is none of the running one's.
    assert runsc_state(stale["container"]) is None
    assert (await sandbox.exec("echo here")).stdout == "here\n"



def test_a_runsc_command_past_its_timeout_is_killed_and_said_so() -> None:
    # runsc's commands are waited for without subprocess's timeout (which
    # polls with sleeps): the timeout is kept by killing the command.
    assert complete(["sh", "-c", "echo said; exit 3"], timeout=30) == (3, b"said\n")
    with pytest.raises(subprocess.TimeoutExpired):
        complete(["sleep", "30"], timeout=0.2)
