"""``hutch shell``: an interactive shell on a PTY inside a docker sandbox, in
process and through the daemon, driven from a real terminal (a PTY here)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

HUTCH = [sys.executable, "-m", "hutch.cli.main"]


def read_until(fd: int, wanted: bytes, within: float = 20) -> bytes:
    seen = b""
    deadline = time.monotonic() + within
    while wanted not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{wanted!r} never came; saw {seen!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side is gone
                break
            if not chunk:
                break
            seen += chunk
    if wanted not in seen:
        raise AssertionError(f"{wanted!r} never came; saw {seen!r}")
    return seen


@pytest.mark.anyio
@pytest.mark.docker
@pytest.mark.parametrize("provider", ["docker", "bubblewrap"])
async def test_pty_in_process_types_reads_and_resizes(provider: str) -> None:
    async with await hutch.create_sandbox(provider, image=TEST_IMAGE, runtime="agent") as sb:
        async with sb.pty(rows=30, cols=100) as term:
            assert sb.open_operations == 1  # an open shell keeps the sandbox busy
            await term.write(b"stty size; echo hi-$((40+2))\r")
            seen = b""
            while b"hi-42" not in seen:
                chunk = await term.read()
                assert chunk is not None, seen
                seen += chunk.data
            assert b"30 100" in seen
            await term.resize(40, 120)
            await term.write(b"stty size; exit 7\r")
            while (chunk := await term.read()) is not None:
                seen += chunk.data
            assert b"40 120" in seen
            assert await term.wait() == 7
        assert sb.open_operations == 0


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    d.stop()


@pytest.mark.docker
def test_hutch_shell_through_the_daemon_on_a_terminal(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as client:
        sb = client.create_sandbox("docker", image=TEST_IMAGE, runtime="agent")
        try:
            primary, secondary = os.openpty()
            env = {**os.environ, "HUTCH_URL": daemon.url, "HUTCH_TOKEN": daemon.token}
            proc = subprocess.Popen(
                [*HUTCH, "shell", sb.id], stdin=secondary, stdout=secondary,
                stderr=secondary, env=env, start_new_session=True,
            )
            os.close(secondary)
            try:
                read_until(primary, b"/workspace#")  # the prompt
                os.write(primary, b"echo from-$((6*7))-inside\r")
                read_until(primary, b"from-42-inside")
                os.write(primary, b"exit 3\r")
                assert proc.wait(20) == 3
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                os.close(primary)
        finally:
            sb.close()


@pytest.mark.docker
def test_hutch_shell_needs_the_token(daemon: DaemonProcess) -> None:
    env = {**os.environ, "HUTCH_URL": daemon.url, "HUTCH_TOKEN": "wrong"}
    done = subprocess.run([*HUTCH, "shell", "sb-whatever"], env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60, check=False)
    assert done.returncode == 5, done.stderr
    assert "unauthorized" in done.stderr


@pytest.mark.docker
def test_hutch_shell_of_no_such_sandbox_is_not_found(daemon: DaemonProcess) -> None:
    env = {**os.environ, "HUTCH_URL": daemon.url, "HUTCH_TOKEN": daemon.token}
    done = subprocess.run([*HUTCH, "shell", "sb-nosuch"], env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60, check=False)
    assert done.returncode == 3, done.stderr
    assert "not_found" in done.stderr


@pytest.mark.docker
def test_pty_through_the_sync_sdk(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as client:
        sb = client.create_sandbox("docker", image=TEST_IMAGE, runtime="agent")
        try:
            with sb.pty(["sh"], rows=33, cols=91, env={"GREETING": "hello"}) as term:
                term.write(b"stty size; echo $GREETING-$((2+2)); exit 4\n")
                seen = b""
                while (chunk := term.read(20)) is not None:
                    seen += chunk.data
                assert b"33 91" in seen and b"hello-4" in seen, seen
                assert term.wait() == 4
            with pytest.raises(hutch.InvalidArgument), sb.pty(rows=0) as term:
                term.wait()
        finally:
            sb.close()


@pytest.mark.anyio
@pytest.mark.docker
async def test_pty_through_the_async_sdk(daemon: DaemonProcess) -> None:
    async with hutch.AsyncClient(daemon.url, token=daemon.token) as client:
        sb = await client.create_sandbox("docker", image=TEST_IMAGE, runtime="agent")
        try:
            async with sb.pty(rows=20, cols=70) as term:
                await term.write(b"stty size; exit 2\r")
                seen = b""
                while (chunk := await term.read()) is not None:
                    seen += chunk.data
                assert b"20 70" in seen, seen
                assert await term.wait() == 2
        finally:
            await sb.close()
