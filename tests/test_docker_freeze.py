"""Exec starts racing pauses on a docker sandbox (native runtime).

runc's exec into a container frozen while the exec starts never returns, and
the Docker Engine then holds its exec store for good: inspect, exec and image
removal hang for every container. The provider keeps its own exec starts and
freezes apart; this test races them and would hang without that.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers.base import ProcessRequest
from hutch.providers.docker import DockerSandbox
from tests.conftest import TEST_IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


def thaw(container: str) -> None:
    """Undo a wedge by hand, so that a failing run does not hang every later test."""
    path = f"/sys/fs/cgroup/freezer/docker/{container}/freezer.state"
    with contextlib.suppress(OSError), open(path, "w") as state:
        state.write("THAWED")


@pytest.fixture
async def sb() -> AsyncIterator[Any]:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="native"
    ) as sandbox:
        yield sandbox


async def test_exec_starts_racing_pauses_finish(sb: Any) -> None:
    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox) and backend.container_id is not None
    container = backend.container_id
    finished = threading.Event()
    thawed_by_hand = threading.Event()

    async def execs() -> None:
        for _ in range(40):
            with contextlib.suppress(hutch.HutchError):  # "is paused" is a fair answer
                proc = await backend.start_process(ProcessRequest(["true"], cwd="/"))
                while await proc.read() is not None:
                    pass
                await proc.wait()

    async def pauses() -> None:
        for _ in range(40):
            await backend.pause()
            await backend.unpause()

    def watchdog() -> None:
        # Without the guard the race wedges the engine: thaw it after a while
        # so the test fails instead of hanging the suite.
        if not finished.wait(90):
            thawed_by_hand.set()
            thaw(container)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(execs)
                tg.start_soon(pauses)
    finally:
        finished.set()
    assert not thawed_by_hand.is_set(), "exec starts and pauses wedged the engine"
    result = await sb.exec(["echo", "alive"])
    assert result.stdout == "alive\n"
