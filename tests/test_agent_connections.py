"""A sandbox's end leaves none of this process's connections to its agent
open: the connections kept for the next request (the runtime's pool) are
closed when the agent goes (suspend, close), not left to garbage collection,
which finds them with a ResourceWarning long after (or never, in a daemon
that keeps its sandboxes' objects)."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import anyio
import pytest

import hutch
from tests.isolating import params, settings


def agent_connections() -> list[str]:
    """The peers (socket paths) of this process's connected Unix sockets
    whose peer is an agent's socket."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(name))
            try:
                if sock.family == socket.AF_UNIX:
                    peer = sock.getpeername()
                    if isinstance(peer, str) and peer.endswith("agent.sock"):
                        found.append(peer)
            finally:
                sock.detach()
    return found


@pytest.mark.anyio
@pytest.mark.parametrize("kind", params("docker-agent", "bubblewrap-agent", "gvisor"))
@pytest.mark.parametrize("end", ["close", "suspend"])
async def test_a_sandbox_s_end_closes_its_agent_connections(kind: str, end: str) -> None:
    before = agent_connections()
    options: dict[str, Any] = settings(kind)
    sandbox = await hutch.create_sandbox(**options)
    try:
        # Requests at once: the pool keeps several connections.
        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(sandbox.exec, "true")
        assert len(agent_connections()) > len(before), "no connection was kept to end"
        if end == "suspend":
            await sandbox.suspend()
            assert agent_connections() == before
            await sandbox.resume()
            assert (await sandbox.exec("echo back")).stdout == "back\n"
    finally:
        await sandbox.close()
    assert agent_connections() == before
