"""Exec starts racing pauses on a docker sandbox (native runtime), and who
owns a container's pause.

runc's exec into a container frozen while the exec starts never returns, and
the Docker Engine then holds its exec store for good: inspect, exec and image
removal hang for every container. The provider keeps its own exec starts and
freezes apart; the race test would hang without that.

The Engine's paused flag lags under load (a late containerd event sets it
again after the next pause or unpause): the provider's freeze guard knows
what it last did and waits the lag out, and a freeze of hutch's own never
undoes, nor leaks, the user's pause.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import docker
import docker.errors
import pytest
import requests

import hutch
from hutch._sandbox import backend_of
from hutch.providers import _docker_engine as docker_engine
from hutch.providers import docker as docker_provider
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


def cgroup_frozen(container: str) -> bool:
    """Whether the kernel holds ``container`` frozen: the truth the Engine's flag lags."""
    v1 = f"/sys/fs/cgroup/freezer/docker/{container}/freezer.state"
    if os.path.exists(v1):
        with open(v1) as state:
            return state.read().strip() == "FROZEN"
    for v2 in (f"/sys/fs/cgroup/system.slice/docker-{container}.scope/cgroup.events",
               f"/sys/fs/cgroup/docker/{container}/cgroup.events"):
        if os.path.exists(v2):
            with open(v2) as events:
                return "frozen 1" in events.read().split("\n")
    raise AssertionError(f"no freezer cgroup found for container {container}")


def engine_refusal(status: int, message: str) -> docker.errors.APIError:
    """An answer as the Engine gives it (the same status and text)."""
    response = requests.Response()
    response.status_code = status
    return docker.errors.APIError(message, response=response, explanation=message)


class LaggingEngine:
    """The real Engine, with its paused flag lagging one call behind, as the
    real one's does under load (20.10.24, a few hundred pause/unpause cycles
    with another container's execs running: an exec refused "is paused" on
    a thawed container just after an unpause, an unpause refused "is not
    paused" on a frozen one just after a pause). Here every transition lags,
    once, so that the provider meets the lag on every call."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._stale: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def pause(self, container: str) -> None:
        self._real.pause(container)
        self._stale = "running"

    def unpause(self, container: str) -> None:
        if self._stale == "running":
            self._stale = None
            raise engine_refusal(500, f"Container {container} is not paused")
        self._real.unpause(container)
        self._stale = "paused"

    def exec_create(self, container: str, *args: Any, **kwargs: Any) -> Any:
        if self._stale == "paused":
            self._stale = None
            raise engine_refusal(
                409, f"Container {container} is paused, unpause the container before exec")
        return self._real.exec_create(container, *args, **kwargs)


async def test_a_lagging_paused_flag_neither_fails_an_exec_nor_leaves_the_sandbox_paused(
    sb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox) and backend.container_id is not None
    container = backend.container_id
    monkeypatch.setattr(docker_engine, "_api_client", LaggingEngine(docker_provider.engine()))
    for _ in range(3):
        await backend.pause()
        assert cgroup_frozen(container)
        await backend.unpause()  # told "is not paused" first
        assert not cgroup_frozen(container)
        result = await sb.exec(["echo", "alive"])  # told "is paused" first
        assert result.stdout == "alive\n"


class SlowToFreezeEngine:
    """The real Engine, whose first pause fails as runc's does when the
    container's tasks do not stop in its short wait (seen under load in CI,
    a writer busy in the container): the cgroup is thawed back."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def pause(self, container: str) -> None:
        if not self.refused:
            self.refused += 1
            raise engine_refusal(500, f"Cannot pause container {container}: OCI runtime "
                                      "pause failed: unable to freeze: unknown")
        self._real.pause(container)


async def test_a_pause_runc_could_not_freeze_at_once_is_tried_again(
    sb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox) and backend.container_id is not None
    slow = SlowToFreezeEngine(docker_provider.engine())
    monkeypatch.setattr(docker_engine, "_api_client", slow)
    await backend.pause()
    assert slow.refused == 1 and cgroup_frozen(backend.container_id)
    await backend.unpause()
    slow.refused = 0
    # A snapshot's own pause too.
    await sb.write_text("a.txt", "A")
    snapshot = await sb.snapshot("slow to freeze")
    try:
        assert slow.refused == 1 and not cgroup_frozen(backend.container_id)
    finally:
        await hutch.remove_snapshot(snapshot)


async def test_a_kill_from_the_host_keeps_the_users_pause(sb: Any) -> None:
    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox) and backend.container_id is not None
    container = backend.container_id
    api = docker.APIClient(version="auto")
    proc = await backend.start_process(ProcessRequest(["sleep", "300"], cwd="/"))
    await backend.pause()
    # Paused: the kill from inside cannot start, the one from the host must
    # neither fail on the pause nor undo it.
    await proc.kill(0.1)
    assert cgroup_frozen(container)
    assert api.inspect_container(container)["State"]["Paused"]
    with pytest.raises(hutch.HutchError, match="paused"):
        await backend.start_process(ProcessRequest(["true"], cwd="/"))
    await backend.unpause()
    assert not cgroup_frozen(container)
    for _ in range(200):  # the SIGKILL lands at the thaw; the Engine's top may lag it
        if not await backend.count_busy_processes():
            break
        await anyio.sleep(0.05)
    assert await backend.count_busy_processes() == 0, "the sleep outlived its kill"
    assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"



async def test_a_snapshot_keeps_the_users_pause_and_undoes_its_own(sb: Any) -> None:
    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox) and backend.container_id is not None
    container = backend.container_id
    await sb.write_text("kept.txt", "kept")
    running = await sb.snapshot("taken-running")  # paused for the capture, then thawed
    try:
        assert not cgroup_frozen(container)
        await sb.pause()
        paused = await sb.snapshot("taken-paused")
        try:
            assert cgroup_frozen(container), "the snapshot undid the user's pause"
            await sb.resume()
            assert not cgroup_frozen(container)
            assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"
        finally:
            await hutch.remove_snapshot(paused)
    finally:
        await hutch.remove_snapshot(running)


#: Another program on the same container (a daemon beside an in-process
#: owner): it starts an exec whose start window it holds open (its process
#: started, the Engine not yet asked whether it runs), says when it is in it
#: and when it left it, then reads the command's output.
_STARTER = """
import asyncio, json, sys, time
from hutch.providers import docker as provider
from hutch.providers.docker import process as exec_start
from hutch.providers.base import ProcessRequest

real = exec_start.wait_until_started

def slow(api, exec_id):
    pid = real(api, exec_id)
    print("in-window", flush=True)
    time.sleep(1.5)
    print("left", time.time(), flush=True)
    return pid

exec_start.wait_until_started = slow

async def main():
    backend = await provider.DockerSandbox.reconnect(sys.argv[1], json.loads(sys.argv[2]))
    proc = await backend.start_process(ProcessRequest(["echo", "started"], cwd="/", env={}))
    out = b""
    while (chunk := await proc.read()) is not None:
        out += chunk.data
    print("output", out.decode().strip(), await proc.wait(), flush=True)

asyncio.run(main())
"""


async def test_a_pause_waits_for_another_program_s_exec_start(sb: Any) -> None:
    """A pause from one program while another program's exec is starting on
    the same container waits until that start is done (a freeze inside it
    would wedge the Engine: runc's exec frozen with the container, and every
    image removal and inspect behind it). The guard of one process cannot
    see another's starts: they are ordered through the hutch home."""
    import json
    import subprocess
    import sys
    import time

    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox) and backend.container_id is not None
    starter = await anyio.to_thread.run_sync(lambda: subprocess.Popen(
        [sys.executable, "-c", _STARTER, sb.id, json.dumps(backend.describe())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ))
    try:
        assert starter.stdout is not None
        line = await anyio.to_thread.run_sync(starter.stdout.readline)
        assert line.strip() == "in-window", (line, starter.stderr.read() if not line else "")
        await sb.pause()
        paused_at = time.time()
        await sb.resume()
        out, err = await anyio.to_thread.run_sync(lambda: starter.communicate(timeout=120))
        left = float(next(x for x in out.splitlines() if x.startswith("left")).split()[1])
        assert paused_at >= left, f"paused {left - paused_at:.3f} s inside the other's start"
        assert "output started 0" in out, (out, err)
    finally:
        if starter.poll() is None:
            starter.kill()
        thaw(backend.container_id)


async def test_a_pause_undone_or_made_by_another_program_is_the_kernels_word(sb: Any) -> None:
    """What this process last made the Engine do is not the truth once
    another program (a daemon, another program sharing the store, the docker
    CLI) undid its pause or made one: an exec start then goes by the kernel's
    freezer. Resumed elsewhere, the container takes execs (refused as paused
    before, until this process unpaused a running container); paused
    elsewhere, an exec is refused as paused at once."""
    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox) and backend.container_id is not None
    container = backend.container_id
    api = docker.APIClient(version="auto")
    await backend.pause()
    api.unpause(container)  # another program's resume
    proc = await backend.start_process(ProcessRequest(["echo", "ran"], cwd="/"))
    assert await proc.wait() == 0
    api.pause(container)  # another program's pause
    try:
        with pytest.raises(hutch.SandboxUnavailable, match="paused"):
            await backend.start_process(ProcessRequest(["true"], cwd="/"))
    finally:
        await backend.unpause()
    assert not cgroup_frozen(container)
    assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"
