"""``hutch mcp``, driven by the ``mcp`` library's own client over stdio (and
once over streamable HTTP) against a real daemon: every tool listed, each
called once as it should be and once with bad input (a tool error that
says what is wrong, never a crash), a 10 MB output capped with a note, the
read-before-write guardrail, and the sandboxes it made killed when it stops.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import CallToolResult

from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess, client, free_port

pytestmark = [pytest.mark.anyio]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOOLS = {
    "sandbox_create", "sandbox_use", "sandbox_list", "exec", "read_file", "write_file",
    "edit_file", "grep", "glob", "list_dir", "pause", "suspend", "resume", "snapshot",
    "fork", "kill",
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    try:
        yield d
    finally:
        d.close()


def _env(d: DaemonProcess, **more: str) -> dict[str, str]:
    return {"HUTCH_URL": d.url, "HUTCH_TOKEN": d.token,
            "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), **more}


@asynccontextmanager
async def mcp_session(d: DaemonProcess, *args: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "hutch.cli.main", "mcp", *args], env=_env(d))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def text(result: CallToolResult) -> str:
    return "\n".join(getattr(c, "text", "") for c in result.content)


async def ok(session: ClientSession, name: str, **arguments: Any) -> str:
    result = await session.call_tool(name, arguments)
    assert not result.is_error, f"{name}({arguments}) failed: {text(result)}"
    return text(result)


async def fails(session: ClientSession, name: str, **arguments: Any) -> str:
    result = await session.call_tool(name, arguments)
    assert result.is_error, f"{name}({arguments}) should fail, answered: {text(result)}"
    return text(result)


async def test_every_tool_is_listed_with_a_described_schema(daemon: DaemonProcess) -> None:
    async with mcp_session(daemon) as session:
        listed = (await session.list_tools()).tools
    assert {t.name for t in listed} == TOOLS
    for tool in listed:
        assert tool.description and len(tool.description) > 30, tool.name
        for name, prop in tool.input_schema.get("properties", {}).items():
            assert prop.get("description"), f"{tool.name}.{name} has no description"
    schema = {t.name: t.input_schema for t in listed}
    assert schema["exec"]["required"] == ["command"]
    assert schema["exec"]["properties"]["timeout"]["exclusiveMinimum"] == 0
    assert set(schema["edit_file"]["required"]) == {"path", "old_string", "new_string"}


async def test_each_tool_once_right_and_once_wrong(daemon: DaemonProcess) -> None:
    async with mcp_session(daemon, "--provider", "local") as session:
        # The first call makes a sandbox with the server's defaults.
        assert "exit code: 0" in await ok(session, "exec", command="echo hi; echo oops >&2")
        assert "exit code: 3" in await ok(session, "exec", command="exit 3")  # an answer
        assert "exec_timeout" in await fails(session, "exec", command="sleep 30", timeout=1)
        assert "timeout" in await fails(session, "exec", command="true", timeout=-1)

        made = await ok(session, "sandbox_create", provider="local")
        first = re.search(r"sandbox (sb-\w+)", made)[1]  # type: ignore[index]
        assert "made and now current" in made
        assert "invalid_argument" in await fails(session, "sandbox_create",
                                                 provider="no-such-provider")
        assert first in await ok(session, "sandbox_list")
        assert "not_found" in await fails(session, "sandbox_use", sandbox="sb-nosuchthing")

        assert "wrote" in await ok(session, "write_file", path="src/app.py",
                                   content="def main():\n    return 41\n\nx = 1\nx = 1\n")
        assert "return 41" in await ok(session, "read_file", path="src/app.py")
        assert await ok(session, "read_file", path="src/app.py", offset=2, limit=1) == \
            "    return 41\n"
        assert "file_not_found" in await fails(session, "read_file", path="nope.txt")
        assert "is_a_directory" in await fails(session, "write_file", path="src",
                                               content="x")
        assert "replaced 1" in await ok(session, "edit_file", path="src/app.py",
                                        old_string="return 41", new_string="return 42")
        assert "return 42" in await ok(session, "exec", command="cat src/app.py")
        assert "occurs 2 times" in await fails(session, "edit_file", path="src/app.py",
                                               old_string="x = 1", new_string="x = 2")
        assert "not in" in await fails(session, "edit_file", path="src/app.py",
                                       old_string="absent", new_string="here")

        assert "src/app.py:2:     return 42" in await ok(session, "grep", pattern=r"return \d+")
        assert "invalid_argument" in await fails(session, "grep", pattern="(unclosed")
        assert "src/app.py" in await ok(session, "glob", pattern="**/*.py")
        assert "at least 1 character" in await fails(session, "glob", pattern="")
        listing = await ok(session, "list_dir", path="src")
        assert re.search(r"file\s+\d+\s+app\.py", listing), listing
        assert "file_not_found" in await fails(session, "list_dir", path="nope")

        snap = await ok(session, "snapshot", label="after edit")
        assert re.match(r"snapshot \S+ of sb-\w+ \(label 'after edit'", snap), snap
        assert "at most 200 characters" in await fails(session, "snapshot", label="x" * 201)
        forked = await ok(session, "fork", label="branch")
        branch = re.search(r"into (sb-\w+)", forked)[1]  # type: ignore[index]
        assert "not_found" in await fails(session, "fork", sandbox="sb-000000000000")
        await ok(session, "write_file", path="only-in-branch.txt", content="b", sandbox=branch)
        assert "file_not_found" in await fails(session, "read_file", path="only-in-branch.txt")
        assert "return 42" in await ok(session, "read_file", path="src/app.py", sandbox=branch)

        # local has no pause: the provider says so, as a tool error.
        assert "capability_unsupported" in await fails(session, "pause")
        assert "capability_unsupported" in await fails(session, "suspend")
        assert "not_found" in await fails(session, "resume", sandbox="sb-000000000000")
        assert "killed" in await ok(session, "kill", sandbox=branch)
        assert "not_found" in await fails(session, "kill", sandbox="sb-000000000000")


@pytest.mark.docker
async def test_the_lifecycle_on_docker(daemon: DaemonProcess) -> None:
    async with mcp_session(daemon) as session:
        await ok(session, "sandbox_create", provider="docker", image=TEST_IMAGE)
        await ok(session, "write_file", path="kept.txt", content="still here")
        assert "paused" in await ok(session, "pause")
        assert "state running" in await ok(session, "resume")
        assert "suspended" in await ok(session, "suspend")
        assert "still here" in await ok(session, "read_file", path="kept.txt")
        assert "killed" in await ok(session, "kill")
        assert "not_found" in await fails(session, "kill", sandbox="sb-000000000000")


async def test_a_10_mb_output_comes_back_capped_with_a_note(daemon: DaemonProcess) -> None:
    async with mcp_session(daemon, "--provider", "local") as session:
        answer = await ok(session, "exec",
                          command="head -c 10000000 /dev/zero | tr '\\0' a; echo; echo END")
    assert "exit code: 0" in answer
    assert len(answer) < 40_000
    note = re.search(r"output cut: stdout was (\d+) bytes; (\d+) bytes in the middle", answer)
    assert note and int(note[1]) == 10_000_005, answer[-2000:]
    assert answer.rstrip().endswith("END")
    assert answer.count("a") > 20_000


async def test_a_write_over_an_unread_file_is_refused_until_it_is_read(
    daemon: DaemonProcess,
) -> None:
    async with mcp_session(daemon, "--provider", "local") as session:
        await ok(session, "exec", command="echo original > notes.txt")
        refused = await fails(session, "write_file", path="notes.txt", content="clobbered")
        assert "read_before_write" in refused and "read it" in refused
        assert "original" in await ok(session, "read_file", path="notes.txt")
        await ok(session, "write_file", path="notes.txt", content="replaced")
        assert "replaced" in await ok(session, "exec", command="cat notes.txt")


async def test_the_sandboxes_it_made_are_killed_when_it_stops(daemon: DaemonProcess) -> None:
    async with mcp_session(daemon, "--provider", "local") as session:
        made = await ok(session, "sandbox_create")
        sandbox_id = re.search(r"sandbox (sb-\w+)", made)[1]  # type: ignore[index]
    with client(daemon) as c:
        for _ in range(100):
            if sandbox_id not in {s["id"] for s in c.list_sandboxes()}:
                break
            await anyio.sleep(0.1)
        assert sandbox_id not in {s["id"] for s in c.list_sandboxes()}


async def test_streamable_http_with_its_token(daemon: DaemonProcess) -> None:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    port = free_port()
    proc = await anyio.open_process(
        [sys.executable, "-m", "hutch.cli.main", "mcp", "--http", "--port", str(port),
         "--provider", "local"],
        env={**os.environ, **_env(daemon, HUTCH_MCP_TOKEN="mcp-secret")},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        async with httpx2.AsyncClient() as plain:
            for _ in range(300):
                try:
                    denied = await plain.post(url, json={})
                    break
                except httpx2.TransportError:
                    await anyio.sleep(0.1)
            assert denied.status_code == 401
        headers = {"Authorization": "Bearer mcp-secret"}
        async with httpx2.AsyncClient(headers=headers, timeout=120) as http, \
                streamable_http_client(url, http_client=http) as (read, write, *_), \
                ClientSession(read, write) as session:
            await session.initialize()
            assert {t.name for t in (await session.list_tools()).tools} == TOOLS
            assert "hello over http" in await ok(session, "exec", command="echo hello over http")
            assert "file_not_found" in await fails(session, "read_file", path="absent")
    finally:
        proc.terminate()
        with anyio.fail_after(30):
            await proc.wait()
    with client(daemon) as c:
        assert not c.list_sandboxes()


def test_the_readme_configures_common_mcp_clients() -> None:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    blocks = re.findall(r"```json\n(.*?)```", readme, flags=re.S)
    servers = [json.loads(b)["mcpServers"]["hutch"] for b in blocks if "mcpServers" in b]
    assert servers and all(s["command"] == "hutch" and s["args"][0] == "mcp" for s in servers)
    assert "claude mcp add hutch -- hutch mcp" in readme


def test_a_sigterm_kills_what_it_made_and_ends_it(daemon: DaemonProcess) -> None:
    """An MCP client that stops the server with SIGTERM (its stdin still
    open, read by a thread no cancellation reaches) leaves nothing behind."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hutch.cli.main", "mcp", "--provider", "local"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env={**os.environ, **_env(daemon)})
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for message in (
            {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
             "params": {"name": "sandbox_create", "arguments": {}}},
        ):
            proc.stdin.write((json.dumps(message) + "\n").encode())
            proc.stdin.flush()
        answers = [json.loads(proc.stdout.readline()) for _ in range(2)]
        made = answers[1]["result"]["content"][0]["text"]
        sandbox_id = re.search(r"sandbox (sb-\w+)", made)[1]  # type: ignore[index]
        with client(daemon) as c:
            assert sandbox_id in {s["id"] for s in c.list_sandboxes()}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        with client(daemon) as c:
            assert sandbox_id not in {s["id"] for s in c.list_sandboxes()}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdin.close()
        proc.stdout.close()
