"""A command refused because its sandbox's pids limit is full is
``resource_exhausted``, not ``provider_error``: the sandbox is sound, it is
full. On every runtime where the limit always refuses a command (docker's
agent, bubblewrap's agent and native runtime), in-process and through the
daemon; once what filled it is killed, the sandbox runs commands again.
Docker's native exec is refused only now and then (see its test)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import hutch
from hutch._types import OutputChunk
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.hazards import FORK_BOMB, fill_with_processes

pytestmark = pytest.mark.docker  # both providers run the test image

#: Small, so that filling it is quick; room for the bomb to fork a few.
PIDS = 40
RUNTIMES = [
    pytest.param(("docker", "agent"), id="docker-agent"),
    pytest.param(("bubblewrap", "agent"), id="bubblewrap-agent"),
    pytest.param(("bubblewrap", "native"), id="bubblewrap-native"),
]


def _settings(provider: str, runtime: str) -> dict[str, Any]:
    settings: dict[str, Any] = {"image": TEST_IMAGE, "runtime": runtime, "pids_limit": PIDS,
                                "read_before_write": False}
    if provider == "bubblewrap":
        settings["ephemeral"] = True
    return settings


@pytest.mark.anyio
@pytest.mark.parametrize("where", RUNTIMES)
async def test_an_exec_in_a_full_sandbox_is_resource_exhausted(where: tuple[str, str]) -> None:
    provider, runtime = where
    sb = await hutch.create_sandbox(provider, **_settings(provider, runtime))
    try:
        bomb, _ = await fill_with_processes(sb)
        try:
            with pytest.raises(hutch.ResourceExhausted) as info:
                await sb.exec(["echo", "no room"], timeout=60)
            assert info.value.code == "resource_exhausted"
            assert info.value.http_status == 429
            assert "pids" in str(info.value) or "process" in str(info.value), info.value
        finally:
            await bomb.kill()
        # The kill answers once the bomb's processes are reaped: room at once.
        assert (await sb.exec(["echo", "room again"], timeout=60)).stdout == "room again\n"
    finally:
        await sb.close()


#: Execs tried in a full docker sandbox on the native runtime.
NATIVE_TRIES = 60


@pytest.mark.anyio
async def test_dockers_native_exec_in_a_full_sandbox_runs_or_is_resource_exhausted() -> None:
    """The engine moves an exec's process into the container's cgroup,
    which the pids limit does not refuse, so a command that forks nothing
    mostly starts; but runc's own process, once moved in, may still need a
    thread of its own (its Go runtime), which is refused, and the engine
    says only that its child went away (here about one exec in fifty). Such
    a refusal is resource_exhausted too, never provider_error."""
    sb = await hutch.create_sandbox("docker", **_settings("docker", "native"))
    try:
        bomb, _ = await fill_with_processes(sb)
        try:
            for _ in range(NATIVE_TRIES):
                try:
                    # What it forks is refused inside: its own result, not hutch's error.
                    forks = await sb.exec(["sh", "-c", "/bin/true; /bin/echo forked"],
                                          timeout=60)
                except hutch.ResourceExhausted as exc:
                    assert "pids limit" in str(exc), exc
                    break  # what is asserted here happened: refused, and said so
                assert forks.exit_code != 0 and "forked" not in forks.stdout, forks
        finally:
            await bomb.kill()
        assert (await sb.exec(["sh", "-c", "/bin/true; /bin/echo forked"])).stdout == "forked\n"
    finally:
        await sb.close()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(token=f"tok-{uuid.uuid4().hex}").start()
    yield d
    d.close()


@pytest.mark.parametrize("where", RUNTIMES)
def test_through_the_daemon_too(daemon: DaemonProcess, where: tuple[str, str]) -> None:
    provider, runtime = where
    with hutch.Client(daemon.url, token=daemon.token) as client:
        sb = client.create_sandbox(provider, **_settings(provider, runtime))
        try:
            bomb = sb.start(["python3", "-c", FORK_BOMB])
            try:
                said = ""
                for event in bomb.stream():
                    if isinstance(event, OutputChunk):
                        said += event.data.decode()
                    if "forked" in said:
                        break
                assert "errno EAGAIN" in said, said
                with pytest.raises(hutch.ResourceExhausted) as info:
                    sb.exec(["echo", "no room"], timeout=60)
                assert info.value.code == "resource_exhausted"
                # On the wire: the status the table gives, the code the client reads.
                answer = httpx.post(
                    f"{daemon.url}/v1/sandboxes/{sb.id}/exec", json={"cmd": ["echo", "x"]},
                    headers={"Authorization": f"Bearer {daemon.token}"}, timeout=60,
                )
                assert answer.status_code == 429, answer.text
                assert answer.json()["error"]["code"] == "resource_exhausted"
            finally:
                bomb.kill()
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(hutch.ResourceExhausted):
                    assert sb.exec(["echo", "room again"]).stdout == "room again\n"
                    break
                assert time.monotonic() < deadline, "the sandbox stayed full"
                time.sleep(0.2)
        finally:
            sb.close()
