"""A command's kill from the host looks for its processes in its sandbox's
cgroup, not among every process of the host: its cost is the sandbox's, and
nothing outside the sandbox is signalled, not even a host process whose
environment carries the command's marker (what the kill matches on).

Where the host kills a command: docker's native runtime, bubblewrap's
native runtime, and a command of a paused docker or bubblewrap sandbox
(either runtime: its agent is frozen). A command that left its process
group and session, its parent gone, is still in the cgroup, and killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest

import hutch
from hutch._liveness import process_start_time
from hutch.providers._proctree import ProcessTree, _send, cgroup_members
from tests import isolating
from tests.hostprocs import named

PIDS_ROOT = "/sys/fs/cgroup/pids"


def _alive(tag: str) -> list[int]:
    return [pid for pid, state, _parent in named(tag) if state not in ("Z", "X")]


def _marker_of(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        env = fh.read().split(b"\0")
    return next(v.decode() for v in env if v.startswith(b"HUTCH_EXEC_ID="))


@contextlib.contextmanager
def _decoy(marker: str) -> Iterator[subprocess.Popen[bytes]]:
    """A host process, outside every sandbox, carrying ``marker``."""
    name, value = marker.split("=", 1)
    decoy = subprocess.Popen(["sleep", "1000"], env={**os.environ, name: value},
                             start_new_session=True)
    try:
        yield decoy
    finally:
        decoy.kill()
        decoy.wait()


async def _until(check: Any, seconds: float = 60) -> None:
    with anyio.move_on_after(seconds):
        while True:
            if check():
                return
            await anyio.sleep(0.05)


# -- the tree among a cgroup's members -------------------------------------------------
@pytest.fixture
def pids_cgroup() -> Iterator[str]:
    """A pids cgroup of the test's own (cgroup v1, as root), with a child."""
    if not os.path.isdir(PIDS_ROOT) or os.geteuid() != 0:
        pytest.skip("needs cgroup v1's pids hierarchy, as root")
    root = f"{PIDS_ROOT}/hutch-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(f"{root}/hutch-workload")
    try:
        yield root
    finally:
        for directory in (f"{root}/hutch-workload", root):
            deadline = time.monotonic() + 10
            while True:
                try:
                    os.rmdir(directory)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


@pytest.mark.anyio
async def test_a_tree_in_a_cgroup_is_found_among_its_members_alone(pids_cgroup: str) -> None:
    """The tree is looked for among the cgroup's processes (the workload's
    child cgroup's too): one that left its group and session, its parent
    gone, is killed; a host process outside the cgroup that carries the
    same marker is not."""
    tag = "ks" + uuid.uuid4().hex[:8]
    value = uuid.uuid4().hex
    marker = f"HUTCH_EXEC_ID={value}"
    workload = f"{pids_cgroup}/hutch-workload"
    # In the child cgroup: a sleep in a session of its own, its shell gone.
    script = (f'echo $$ > {workload}/cgroup.procs && cp "$(command -v sleep)" /tmp/{tag} '
              f"&& (setsid /tmp/{tag} 1000 &) && exec /tmp/{tag} 1000")
    # (reaped by the loop's child watcher as the kill goes: the kill waits for its reaping)
    leader = await anyio.open_process(["sh", "-c", script],
                                      env={**os.environ, "HUTCH_EXEC_ID": value},
                                      start_new_session=True)
    try:
        await _until(lambda: len(_alive(tag)) >= 2)
        inside = _alive(tag)
        assert len(inside) == 2, inside
        assert set(inside) <= set(cgroup_members(pids_cgroup))
        with _decoy(marker) as decoy:
            tree = ProcessTree(marker, cgroup=pids_cgroup)
            assert decoy.pid not in tree.candidates()
            await tree.kill(0)
            assert decoy.poll() is None, "a host process outside the cgroup was signalled"
        await _until(lambda: not _alive(tag))
        assert _alive(tag) == []
    finally:
        with contextlib.suppress(OSError):
            os.unlink(f"/tmp/{tag}")
        for pid in _alive(tag):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        with contextlib.suppress(ProcessLookupError):
            leader.kill()
        await leader.wait()
        await _until(lambda: not cgroup_members(pids_cgroup), 10)


def test_a_cgroup_gone_has_no_members() -> None:
    """A sandbox's cgroup removed (its processes all gone): nothing to kill,
    and not the host's processes instead."""
    assert cgroup_members(f"/sys/fs/cgroup/pids/hutch-test-gone-{uuid.uuid4().hex}") == []


def test_a_pid_another_process_took_since_it_was_seen_gets_no_signal() -> None:
    """A process of the tree seen, then gone, its pid taken by a process
    outside the sandbox before the signal: the signal goes to the process
    seen (the pid and its start time) or to none."""
    other = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        start = process_start_time(other.pid)
        assert start is not None
        _send(other.pid, start - 1, signal.SIGKILL)  # the one seen started earlier
        assert other.poll() is None, "a process that took a seen pid was signalled"
        _send(other.pid, start, signal.SIGKILL)  # the one seen
        assert other.wait(10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


@pytest.mark.anyio
async def test_a_later_group_under_the_command_s_group_number_is_spared() -> None:
    """A command's group gone, its number taken since by another process's
    group (the same number here, as once the pid space has gone round): the
    command's kill neither counts that group's processes among its own nor
    signals the group."""
    later = await anyio.open_process(["sleep", "1000"], start_new_session=True)
    try:
        # The command's leader, which started before (it had another start).
        start = process_start_time(later.pid)
        assert start is not None
        tree = ProcessTree(f"HUTCH_EXEC_ID={uuid.uuid4().hex}", group=later.pid,
                           leader_start=start - 1)
        assert tree.alive() == []
        await tree.kill(0.1, bound=1)
        assert later.returncode is None and process_start_time(later.pid) == start, (
            "a later group under the same number was killed")
    finally:
        later.kill()
        await later.wait()


@pytest.mark.anyio
@pytest.mark.parametrize("leader", ["marked", "cleared"])
async def test_the_command_s_group_is_killed_while_the_command_holds_it(leader: str) -> None:
    """While the command holds its group (its leader, known by its start, or
    a member carrying its marker), every member is killed with it, one that
    cleared its environment too; a leader that cleared its own as well."""
    marker = f"HUTCH_EXEC_ID={uuid.uuid4().hex}"
    env = {**os.environ, "HUTCH_EXEC_ID": marker.split("=", 1)[1]}
    command = (["sh", "-c", "env -i sleep 1001 & wait"] if leader == "marked"
               else ["env", "-i", "sleep", "1002"])
    proc = await anyio.open_process(command, env=env, start_new_session=True)
    try:
        start = process_start_time(proc.pid)
        assert start is not None
        tree = ProcessTree(marker, group=proc.pid, leader_start=start)
        await _until(lambda: len(tree.alive()) == (2 if leader == "marked" else 1))
        members = tree.alive()
        async with anyio.create_task_group() as tg:
            tg.start_soon(proc.wait)  # its parent reaps it
            await tree.kill(0.1, bound=5)
        for pid in members:
            assert process_start_time(pid) is None, f"{pid} outlived the kill"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


# -- from the providers ------------------------------------------------------------------
@pytest.fixture
async def sandbox(request: pytest.FixtureRequest) -> AsyncIterator[hutch.Sandbox]:
    async with await hutch.create_sandbox(
        **isolating.settings(request.param, pids_limit=256), read_before_write=False
    ) as sb:
        yield sb


def _command(tag: str) -> str:
    """A sleep named ``tag``, with another in a session of its own whose
    parent is gone."""
    return (f'cp "$(command -v sleep)" ./{tag} && (setsid ./{tag} 1000 &) '
            f"&& exec ./{tag} 1000")


async def _started_pair(sandbox: hutch.Sandbox) -> tuple[str, Any, list[int]]:
    """(tag, process, the host pids of its two sleeps) of :func:`_command` started."""
    tag = "ks" + uuid.uuid4().hex[:8]
    process = await sandbox.start(_command(tag))
    await _until(lambda: len(_alive(tag)) >= 2)
    inside = _alive(tag)
    assert len(inside) == 2, inside
    return tag, process, inside


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("sandbox", isolating.params("docker-native", "bubblewrap-native"),
                         indirect=True)
async def test_a_kill_from_the_host_signals_nothing_outside_the_sandbox(
    sandbox: hutch.Sandbox,
) -> None:
    tag, process, inside = await _started_pair(sandbox)
    with _decoy(_marker_of(inside[0])) as decoy:
        await process.kill()
        assert decoy.poll() is None, "a host process outside the sandbox was signalled"
    assert _alive(tag) == []


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("sandbox", isolating.params("docker-agent", "bubblewrap-agent",
                                                     "docker-native", "bubblewrap-native"),
                         indirect=True)
async def test_a_kill_in_a_paused_sandbox_signals_nothing_outside_it(
    sandbox: hutch.Sandbox,
) -> None:
    tag, process, inside = await _started_pair(sandbox)
    with _decoy(_marker_of(inside[0])) as decoy:
        await sandbox.pause()
        try:
            await process.kill()
        finally:
            await sandbox.resume()
        assert decoy.poll() is None, "a host process outside the sandbox was signalled"
    await _until(lambda: not named(tag))
    assert _alive(tag) == []
