"""When a command's end answers (its exec's timeout, a background command's
kill, a stream closed early), the command's whole process tree is gone: no
process of it remains, not even a zombie, to hold the sandbox's pids,
memory or files. Its tree here has many children, some ignoring SIGTERM,
one in a session of its own.

The tree's processes are found from the host, by name (their ``comm``,
which a zombie keeps): every process of it runs a copy of bash or sleep
named after the test. Not gvisor (its processes are runsc's on the host,
not named as the command's), nor kubernetes (its stand-in's pods are docker
containers, which docker covers).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import hutch
from tests import isolating

KINDS = ["local", *isolating.params("docker-agent", "docker-native", "bubblewrap-agent",
                                    "bubblewrap-native")]

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


def named(tag: str) -> list[tuple[int, str, int]]:
    """(pid, state, parent) of the host's processes whose name starts with ``tag``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if comm.startswith(tag):
            found.append((int(entry.name), fields[0], int(fields[1])))
    return found


def remaining(kind: str, tag: str) -> list[tuple[int, str, int]]:
    """What is left of the tree. On local, a zombie adopted by the host's
    PID 1 is left out: the local provider's orphans are the host's, and this
    host's init (a container's) may never reap them; they hold no memory nor
    files, and no sandbox limit."""
    return [p for p in named(tag) if not (kind == "local" and p[1] == "Z" and p[2] == 1)]


@pytest.fixture
async def sandbox(request: pytest.FixtureRequest) -> AsyncIterator[hutch.Sandbox]:
    kind = request.param
    if kind == "local":
        workdir = tempfile.mkdtemp(prefix="hutch-reap-")
        async with await hutch.create_sandbox("local", workdir=workdir) as sb:
            yield sb
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        async with await hutch.create_sandbox(
            **isolating.settings(kind, pids_limit=256), read_before_write=False
        ) as sb:
            yield sb


async def _tree_command(sb: hutch.Sandbox) -> tuple[str, str]:
    """(tag, the command that runs the tree)."""
    tag = "rp" + uuid.uuid4().hex[:8]
    await sb.write_text("tree.sh", TREE.format(tag=tag))
    return tag, (f'cp "$(command -v bash)" ./{tag}a && cp "$(command -v sleep)" ./{tag}b '
                 f"&& exec ./{tag}a ./tree.sh")


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
async def test_a_killed_background_command_is_gone_when_its_kill_returns(
    sandbox: hutch.Sandbox, request: Any
) -> None:
    kind = request.node.callspec.params["sandbox"]
    tag, command = await _tree_command(sandbox)
    process = await sandbox.start(command)
    assert await _until_grown(tag) >= TREE_SIZE
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
        assert await _until_grown(tag) >= TREE_SIZE
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert remaining(kind, tag) == []
