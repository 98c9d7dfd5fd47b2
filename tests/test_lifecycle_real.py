"""Lifecycle on real providers and real time: docker cycles, work-aware idleness."""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Any

import docker
import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.states import SandboxState
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.anyio


async def wait_for_state(sb: Any, state: SandboxState, within: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within:
        if sb.state == state:
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise AssertionError(f"sandbox stayed {sb.state} for {within} s, expected {state}")


def container_of(sb: hutch.Sandbox) -> str:
    return str(getattr(backend_of(sb), "container_id", None))


def container_exists(container_id: str) -> bool:
    return any(c["Id"] == container_id for c in docker.APIClient().containers(all=True))


@pytest.mark.docker
async def test_twenty_suspend_resume_cycles_keep_every_file(docker_runtime: str) -> None:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime=docker_runtime
    ) as sb:
        for i in range(20):
            await sb.write_text(f"/root/cycle-{i}.txt", f"rootfs {i}")
            await sb.write_text(f"work-{i}.txt", f"workspace {i}")
            container = container_of(sb)
            await sb.suspend()
            assert sb.state == SandboxState.SUSPENDED
            assert not container_exists(container), "suspend left the container (and its memory)"
            await sb.resume()
            listing = await sb.exec("cat /root/cycle-*.txt; cat work-*.txt")
            for j in range(i + 1):
                assert f"rootfs {j}" in listing.stdout
                assert f"workspace {j}" in listing.stdout
        assert sb.status().meter["suspended_s"] > 0


@pytest.mark.docker
async def test_twenty_pause_resume_cycles_keep_files_and_processes(docker_runtime: str) -> None:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime=docker_runtime
    ) as sb:
        await sb.exec("nohup sleep 600 >/dev/null 2>&1 &")
        for i in range(20):
            await sb.write_text(f"/root/p-{i}.txt", str(i))
            await sb.pause()
            assert sb.state == SandboxState.PAUSED
            await sb.resume()
            # Every file so far, in one look (a read each costs an archive
            # call apiece on the native runtime: 200 of them, 11 s).
            listing = await sb.exec("for f in /root/p-*.txt; do echo \"$f=$(cat \"$f\")\"; done")
            assert sorted(listing.stdout.split()) == sorted(
                f"/root/p-{j}.txt={j}" for j in range(i + 1))
        assert "sleep 600" in (await sb.exec("ps -eo args")).stdout


@pytest.mark.docker
async def test_suspended_docker_sandbox_auto_resumes_or_refuses(docker_runtime: str) -> None:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, idle_suspend_after=1, runtime=docker_runtime
    ) as sb:
        await sb.write_text("/root/kept.txt", "kept")
        container = container_of(sb)
        await wait_for_state(sb, SandboxState.SUSPENDED, within=8)
        assert not container_exists(container)
        result = await sb.exec(["cat", "/root/kept.txt"])
        assert result.stdout == "kept"
        assert sb.state == SandboxState.RUNNING
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, idle_suspend_after=1, auto_resume=False,
        runtime=docker_runtime,
    ) as strict:
        await wait_for_state(strict, SandboxState.SUSPENDED, within=8)
        with pytest.raises(hutch.SandboxUnavailable):
            await strict.exec(["true"])


@pytest.mark.docker
async def test_background_job_keeps_docker_sandbox_from_idle_suspend(
    docker_runtime: str,
) -> None:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, idle_suspend_after=1, runtime=docker_runtime
    ) as sb:
        await sb.exec("nohup sleep 4 >/dev/null 2>&1 &")
        await asyncio.sleep(3.5)
        assert sb.state == SandboxState.RUNNING, "suspended while a job was running"
        await wait_for_state(sb, SandboxState.SUSPENDED, within=8)


async def test_nohup_job_keeps_local_sandbox_from_idle_reaping() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        sb = await hutch.create_sandbox("local", workdir=workdir, idle_timeout=1)
        await sb.exec("nohup sleep 4 >/dev/null 2>&1 &")
        await asyncio.sleep(3.5)
        assert sb.state == SandboxState.RUNNING, "reaped while a job was running"
        await wait_for_state(sb, SandboxState.TERMINATED, within=8)
        with pytest.raises(hutch.IdleTimeoutExpired):
            await sb.exec(["true"])


async def test_background_command_through_hutch_counts_as_work() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        async with await hutch.create_sandbox("local", workdir=workdir, idle_timeout=1) as sb:
            process = await sb.start("sleep 3")
            await asyncio.sleep(2.5)
            assert sb.state == SandboxState.RUNNING
            await process.wait(timeout=5)
            await wait_for_state(sb, SandboxState.TERMINATED, within=8)


async def test_real_set_timeout_deadlines() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        async with await hutch.create_sandbox("local", workdir=workdir, idle_timeout=1) as sb:
            before = time.time()
            deadline = await sb.set_timeout(3)
            assert before + 3 <= deadline <= time.time() + 3
            with pytest.raises(hutch.TimeoutTooLarge, match="86400"):
                await sb.set_timeout(86401)
            await asyncio.sleep(2)
            assert sb.state == SandboxState.RUNNING  # idle 2 s > 1 s, the deadline rules
            await wait_for_state(sb, SandboxState.TERMINATED, within=4)
            assert sb.status().reason == "timeout_expired"
        async with await hutch.create_sandbox("local", workdir=workdir) as past:
            await past.set_timeout(0)
            await wait_for_state(past, SandboxState.TERMINATED, within=2)
            with pytest.raises(hutch.TimeoutExpired):
                await past.exec(["true"])


@pytest.mark.docker
async def test_nohup_job_keeps_docker_sandbox_from_suspend_and_reaping(
    docker_runtime: str,
) -> None:
    sb = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, idle_suspend_after=1, idle_timeout=2,
        runtime=docker_runtime,
    )
    try:
        await sb.exec("nohup sleep 600 >/dev/null 2>&1 &")
        await asyncio.sleep(3)
        assert sb.state == SandboxState.RUNNING, "a sandbox with a running job went idle"
        await sb.exec("pkill -f 'sleep 600'; true")
        await wait_for_state(sb, SandboxState.TERMINATED, within=8)
        assert sb.status().reason == "idle_timeout"
        with pytest.raises(hutch.IdleTimeoutExpired, match="make a new sandbox"):
            await sb.exec(["true"])
    finally:
        await sb.close()


async def test_close_returns_once_an_expired_sandbox_is_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sandbox its timer ended is released in the background (its reap);
    the owner's close meanwhile waits for that release, instead of returning
    at once with the sandbox still held (a test, or a program, that ended
    right after would leave it behind: the reap is cancelled with its loop)."""
    from hutch.providers.local import LocalSandbox

    released = asyncio.Event()
    close = LocalSandbox.close

    async def slow_close(self: LocalSandbox) -> None:
        await asyncio.sleep(0.5)
        await close(self)
        released.set()

    monkeypatch.setattr(LocalSandbox, "close", slow_close)
    sb = await hutch.create_sandbox("local", read_before_write=False)
    await sb.set_timeout(0.2)
    await wait_for_state(sb, SandboxState.TERMINATED, within=8)
    assert not released.is_set()
    await sb.close()
    assert released.is_set(), "close returned while the sandbox was still being released"
