"""Conformance: the sandbox's own surface (status, processes, preview URL,
paths, capabilities) answers alike in-process and through both SDK faces."""

from __future__ import annotations

import inspect
import io
from typing import Any

import pytest

import hutch
from hutch.lifecycle.engine import SandboxStatus
from hutch.lifecycle.state import SandboxState

pytestmark = pytest.mark.anyio


async def settle(value: Any) -> Any:
    """In-process status() and processes() are plain calls; remote ones are awaited."""
    return await value if inspect.isawaitable(value) else value


async def test_status_is_a_sandbox_status(sandbox: Any) -> None:
    status = await settle(sandbox.status())
    assert isinstance(status, SandboxStatus)
    assert status.id == sandbox.id
    assert status.state is SandboxState.RUNNING
    assert set(status.meter) == {"running_s", "paused_s", "suspended_s"}
    assert sandbox.state is SandboxState.RUNNING
    meter = sandbox.meter
    assert isinstance(meter, dict) and meter["running_s"] >= 0.0


async def test_info_describes_the_sandbox(sandbox: Any) -> None:
    info = await sandbox.info()
    assert info["id"] == sandbox.id
    assert info["provider"] == sandbox.provider
    assert info["workdir"] == sandbox.workdir
    assert info["state"] == "running"
    assert info["capabilities"]["processes"] is True
    assert info["open_operations"] == 0


async def test_processes_are_listed_and_found(sandbox: Any) -> None:
    assert await settle(sandbox.processes()) == []
    started = await sandbox.start("sleep 30")
    try:
        listed = await settle(sandbox.processes())
        assert [p.id for p in listed] == [started.id]
        assert listed[0].running and listed[0].command == "sleep 30"
        found = await settle(sandbox.process(started.id))
        assert found.id == started.id and found.running
        assert sandbox.open_operations == 1 or (await sandbox.info())["open_operations"] == 1
    finally:
        await started.kill()
    with pytest.raises(hutch.NotFound, match="nothing"):
        await settle(sandbox.process("nothing"))


async def test_preview_url_names_the_port(sandbox: Any) -> None:
    if not sandbox.capabilities.supports("preview_url"):
        with pytest.raises(hutch.CapabilityUnsupported):
            await sandbox.preview_url(8000)
        return
    url = await sandbox.preview_url(8000)
    assert isinstance(url, str) and url.startswith("http") and "8000" in url
    with pytest.raises(hutch.InvalidArgument, match="65535"):
        await sandbox.preview_url(70000)


async def test_paths_and_capabilities_are_checked_alike(sandbox: Any) -> None:
    assert sandbox.path("a/../b.txt") == sandbox.workdir.rstrip("/") + "/b.txt"
    assert sandbox.path("/etc/x") == "/etc/x"
    with pytest.raises(hutch.InvalidArgument, match="NUL"):
        sandbox.path("a\0b")
    sandbox.require("processes")
    with pytest.raises(hutch.CapabilityUnsupported, match="teleport"):
        sandbox.require("teleport")  # no provider has it
    for name, has in sandbox.capabilities.as_dict().items():
        if has is False:
            with pytest.raises(hutch.CapabilityUnsupported, match=name):
                sandbox.require(name)
    assert sandbox.closed is False


async def test_write_from_a_file_object(sandbox: Any) -> None:
    source = io.BytesIO(b"skip:" + bytes(range(256)))
    source.seek(5)  # from its position on
    await sandbox.write_from("from-file.bin", source)
    assert await sandbox.read_bytes("from-file.bin") == bytes(range(256))


async def test_read_pieces_streams_a_file(files_sandbox: Any) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    await files_sandbox.write_bytes("big.bin", data)
    pieces = [piece async for piece in files_sandbox.read_pieces("big.bin")]
    assert b"".join(pieces) == data
    with pytest.raises(FileNotFoundError):
        async for _ in files_sandbox.read_pieces("no-such.bin"):
            pass
