"""The sandbox's own surface (status, processes, preview URL, paths,
capabilities) answers alike in-process and through both SDK faces."""

from __future__ import annotations

import io
from typing import Any

import hutch
from hutch.states import SandboxState, SandboxStatus

from ._support import Case, raises, refused, settle


async def check_status_is_a_sandbox_status(sandbox: Any) -> None:
    status = await settle(sandbox.status())
    assert isinstance(status, SandboxStatus)
    assert status.id == sandbox.id
    assert status.state is SandboxState.RUNNING
    assert set(status.meter) == {"running_s", "paused_s", "suspended_s"}
    assert sandbox.state is SandboxState.RUNNING
    meter = sandbox.meter
    assert isinstance(meter, dict) and meter["running_s"] >= 0.0


async def check_info_describes_the_sandbox(sandbox: Any) -> None:
    info = await sandbox.info()
    assert info["id"] == sandbox.id
    assert info["provider"] == sandbox.provider
    assert info["workdir"] == sandbox.workdir
    assert info["state"] == "running"
    assert info["capabilities"]["processes"] is sandbox.capabilities.processes
    assert info["open_operations"] == 0


async def check_processes_are_listed_and_found(sandbox: Any) -> None:
    if not sandbox.capabilities.processes:
        await refused(sandbox.start("sleep 30"))
        return
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
    with raises(hutch.NotFound, match="nothing"):
        await settle(sandbox.process("nothing"))


async def check_preview_url_addresses_each_port(sandbox: Any) -> None:
    if not sandbox.capabilities.supports("preview_url"):
        with raises(hutch.CapabilityUnsupported):
            await sandbox.preview_url(8000)
        return
    url = await sandbox.preview_url(8000)
    # An address of the port: the sandbox's own (docker, bubblewrap) or a
    # forward the provider keeps (kubernetes' port-forward on a local port),
    # the same for one port each time it is asked, another for another port.
    assert isinstance(url, str) and url.startswith("http")
    assert await sandbox.preview_url(8000) == url
    assert await sandbox.preview_url(8001) != url
    with raises(hutch.InvalidArgument, match="65535"):
        await sandbox.preview_url(70000)


async def check_paths_and_capabilities_are_checked_alike(sandbox: Any) -> None:
    assert sandbox.path("a/../b.txt") == sandbox.workdir.rstrip("/") + "/b.txt"
    assert sandbox.path("/etc/x") == "/etc/x"
    with raises(hutch.InvalidArgument, match="NUL"):
        sandbox.path("a\0b")
    if sandbox.capabilities.processes:
        sandbox.require("processes")
    with raises(hutch.CapabilityUnsupported, match="teleport"):
        sandbox.require("teleport")  # no provider has it
    for name, has in sandbox.capabilities.as_dict().items():
        if has is False:
            with raises(hutch.CapabilityUnsupported, match=name):
                sandbox.require(name)
    assert sandbox.closed is False


async def check_write_from_a_file_object(sandbox: Any) -> None:
    source = io.BytesIO(b"skip:" + bytes(range(256)))
    source.seek(5)  # from its position on
    await sandbox.write_from("from-file.bin", source)
    assert await sandbox.read_bytes("from-file.bin") == bytes(range(256))


async def check_read_pieces_streams_a_file(sandbox: Any) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    await sandbox.write_bytes("big.bin", data)
    pieces = [piece async for piece in sandbox.read_pieces("big.bin")]
    assert b"".join(pieces) == data
    with raises(FileNotFoundError):
        async for _ in sandbox.read_pieces("no-such.bin"):
            pass


SURFACE_CASES: list[Case] = [
    check_status_is_a_sandbox_status,
    check_info_describes_the_sandbox,
    check_processes_are_listed_and_found,
    check_preview_url_addresses_each_port,
    check_paths_and_capabilities_are_checked_alike,
    check_write_from_a_file_object,
    check_read_pieces_streams_a_file,
]
