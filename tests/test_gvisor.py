"""The gvisor provider: what runsc adds beyond the conformance suite (which
runs every case its capabilities declare): processes that live through a
suspend, and checkpoints tied to the runsc build that wrote them."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers.gvisor.checkpoints import META, CheckpointBuildMismatch
from tests.conftest import TEST_IMAGE

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.docker,
    pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed"),
]

COUNTER = (
    "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' "
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
