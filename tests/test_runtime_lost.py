"""In process, where no watch runs: a call that finds its sandbox's runtime
gone for good (removed or killed outside hutch) fails the sandbox with that
as its reason, so that what the sandbox says of itself is true from then
on (SPEC §3: failed is for good), and later calls say why. A runtime that
is still there is never failed on a call's error.

The daemon's watches tell the same within seconds (tests/test_outside_deaths.py);
here the call itself is the one that finds out.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import docker
import pytest

import hutch
from hutch._liveness import still_running
from hutch._sandbox import backend_of
from hutch.providers.bubblewrap import BubblewrapSandbox
from hutch.providers.docker import DockerSandbox
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.anyio


def remove_container(sb: hutch.Sandbox) -> None:
    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox) and backend.container_id is not None
    docker.APIClient().remove_container(backend.container_id, force=True)


def kill_keeper(sb: hutch.Sandbox) -> None:
    """bwrap's init, PID 1 of the sandbox, killed and gone (a kill is sent,
    not done: until it is, the sandbox may still answer)."""
    backend = backend_of(sb)
    assert isinstance(backend, BubblewrapSandbox)
    keeper = backend.describe()["keeper"]
    os.kill(int(keeper["init_pid"]), signal.SIGKILL)
    # Gone whole: its init, and the outer bwrap that waits on it (through
    # which the host reaches the sandbox's files until it ends too).
    deadline = time.monotonic() + 10
    while (still_running(int(keeper["init_pid"]), int(keeper["start_time"]))
           or os.path.exists(f"/proc/{int(keeper['outer_pid'])}/ns/mnt")):
        assert time.monotonic() < deadline, "the keeper outlived its SIGKILL"
        time.sleep(0.01)


KILLS: dict[str, tuple[str, dict[str, Any], Callable[[hutch.Sandbox], None]]] = {
    "docker-removed": ("docker", {"image": TEST_IMAGE}, remove_container),
    "docker-native-removed": ("docker", {"image": TEST_IMAGE, "runtime": "native"},
                              remove_container),
    "bubblewrap-keeper-killed": ("bubblewrap", {"ephemeral": True}, kill_keeper),
}


def _marks(provider: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.docker] if provider == "docker" else []


CALLS: dict[str, Callable[[hutch.Sandbox], Awaitable[object]]] = {
    "exec": lambda sb: sb.exec("true"),
    "read": lambda sb: sb.read_text("kept.txt"),
    "write": lambda sb: sb.write_text("more.txt", "x"),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize(
    "how", [pytest.param(k, marks=_marks(v[0])) for k, v in KILLS.items()]
)
async def test_a_call_that_finds_the_runtime_gone_fails_the_sandbox(how: str, call: str) -> None:
    provider, settings, kill = KILLS[how]
    async with await hutch.create_sandbox(provider, **settings) as sb:
        await sb.write_text("kept.txt", "work of hours")
        kill(sb)
        with pytest.raises(hutch.SandboxUnavailable):
            await CALLS[call](sb)
        info = await sb.info()
        assert info["state"] == "failed", info
        assert info["reason"] and "outside hutch" in info["reason"], info
        # Said so from now on, by every call, and for good.
        with pytest.raises(hutch.SandboxUnavailable) as caught:
            await sb.exec("true")
        assert "failed" in str(caught.value) and "outside hutch" in str(caught.value)
        assert sb.state.value == "failed"


@pytest.mark.docker
async def test_a_calls_error_never_fails_a_runtime_that_is_there() -> None:
    """A call refused for a reason of its own (a file that is not there, a
    directory read as a file) leaves a live sandbox running."""
    async with await hutch.create_sandbox("docker", image=TEST_IMAGE) as sb:
        with pytest.raises(hutch.HutchError):
            await sb.read_text("/no/such/file")
        with pytest.raises(hutch.HutchError):
            await sb.read_text("/etc")
        assert (await sb.info())["state"] == "running"
        assert (await sb.exec("echo ok")).stdout == "ok\n"
