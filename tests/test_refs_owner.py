"""Refs of an in-process owner (no daemon), used from other OS processes
(issue 9): the owner serves its one sandbox on a private unix socket that
its refs name, and stops serving it when it closes."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

import hutch
from hutch._refwire import decode_ref, unix_socket_of
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.anyio

#: A worker in another process: attaches with the ref (argv[1]), then runs
#: the lines it is sent on stdin one at a time, answering each with one line.
WORKER = r"""
import json, sys, hutch

def pty_run(sb, line):
    out = b""
    with sb.pty(["sh", "-c", line]) as term:
        while (chunk := term.read(timeout=60)) is not None:
            out += chunk.data
        return [out.decode().strip(), term.wait()]

sb = hutch.attach_sync(sys.argv[1])
print(json.dumps({"ok": sb.id}), flush=True)
for line in sys.stdin:
    try:
        value = eval(line)
        print(json.dumps({"ok": value}), flush=True)
    except hutch.HutchError as exc:
        print(json.dumps({"error": exc.code, "message": str(exc)}), flush=True)
"""


def bare_env() -> dict[str, str]:
    """No daemon anywhere: only the ref may say where the sandbox is."""
    return {k: v for k, v in os.environ.items() if k not in ("HUTCH_URL", "HUTCH_TOKEN")}


class Worker:
    """Another OS process, attached with a ref, driven a line at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, ref: str) -> tuple[Worker, dict[str, Any]]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WORKER, ref, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=bare_env(),
        )
        worker = cls(proc)
        return worker, await worker._answer()

    async def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        if not line:
            assert self.proc.stderr is not None
            raise AssertionError((await self.proc.stderr.read()).decode()[-3000:])
        import json

        answer: dict[str, Any] = json.loads(line)
        return answer

    async def run(self, expression: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(expression.encode() + b"\n")
        await self.proc.stdin.drain()
        return await self._answer()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
async def owner(request: pytest.FixtureRequest) -> AsyncIterator[hutch.Sandbox]:
    if request.param == "local":
        sb = await hutch.create_sandbox("local", workdir=tempfile.mkdtemp())
    else:
        sb = await hutch.create_sandbox("docker", image=TEST_IMAGE)
    try:
        yield sb
    finally:
        await sb.close()


async def test_owner_and_a_worker_in_another_process_share_one_live_sandbox(
    owner: hutch.Sandbox,
) -> None:
    await owner.write_text("from-owner.txt", "o")
    mine = await owner.start("sleep 120")
    ref = await owner.ref()
    worker, hello = await Worker.start(ref)
    other: Worker | None = None
    try:
        assert hello == {"ok": owner.id}
        assert await worker.run("sb.read_text('from-owner.txt')") == {"ok": "o"}
        assert await worker.run("sb.write_text('from-worker.txt', 'w')") == {"ok": None}
        assert await owner.read_text("from-worker.txt") == "w"
        # Processes both ways: the owner's command is the worker's to see, and back.
        seen = await worker.run("[p.id for p in sb.processes()]")
        assert mine.id in seen["ok"]
        theirs = (await worker.run("sb.start('sleep 120').id"))["ok"]
        assert theirs in [p.id for p in owner.processes()]
        ran = await worker.run("sb.exec('echo $((6*7))').stdout")
        assert ran == {"ok": "42\n"}
        # A terminal too (a websocket, over the same socket).
        typed = await worker.run("pty_run(sb, 'cat from-owner.txt; exit 3')")
        if owner.capabilities.runtime == "agent":
            assert typed == {"ok": ["o", 3]}, typed
        else:  # the answer came through: the native runtime has no terminal
            assert typed["error"] == "capability_unsupported", typed
        # Listed on the sandbox while attached, with the ref it came in with.
        listed = (await owner.info())["attachments"]
        assert [a["ref_id"] for a in listed] == [decode_ref(ref).ref_id]  # type: ignore[union-attr]
        # Read-before-write is the worker's own: the owner's read is not its read.
        await owner.write_text("guarded.txt", "g")
        await owner.read_text("guarded.txt")
        refused = await worker.run("sb.write_text('guarded.txt', 'w2')")
        assert refused["error"] == "read_before_write", refused
        assert await worker.run("sb.read_text('guarded.txt')") == {"ok": "g"}
        assert await worker.run("sb.write_text('guarded.txt', 'w2')") == {"ok": None}
        assert await owner.read_text("guarded.txt") == "w2"
        # From the command line too, with the ref alone.
        cli = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "hutch.cli.main", "attach", ref, "--", "cat",
                             "from-worker.txt"],
            capture_output=True, text=True, timeout=120, env=bare_env(), stdin=subprocess.DEVNULL,
        )
        assert (cli.returncode, cli.stdout) == (0, "w"), cli.stderr
        # The worker's close only detaches it: the owner goes on.
        assert await worker.run("sb.close()") == {"ok": None}
        detached = await worker.run("sb.exec('true')")
        assert detached["error"] == "sandbox_unavailable" and "detached" in detached["message"]
        assert (await owner.exec("echo still")).stdout == "still\n"
        assert owner.state is hutch.SandboxState.RUNNING
        assert (await owner.info())["attachments"] == []
        # A worker attached when the owner closes: its next call says why it failed.
        other, _ = await Worker.start(await owner.ref())
        assert (await other.run("sb.exec('echo x').stdout")) == {"ok": "x\n"}
        await owner.close()
        ended = await other.run("sb.read_text('from-owner.txt')")
        assert ended["error"] == "sandbox_unavailable", ended
        assert "owner's cleanup ended it" in ended["message"]
        late = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", "import hutch, sys; hutch.attach_sync(sys.argv[1])", ref],
            capture_output=True, text=True, timeout=120, env=bare_env(),
        )
        assert late.returncode != 0 and "owner's cleanup ended it" in late.stderr
    finally:
        await worker.stop()
        if other is not None:
            await other.stop()


async def test_the_owners_socket_is_private_and_answers_its_refs_alone() -> None:
    owner = await hutch.create_sandbox("local", workdir=tempfile.mkdtemp())
    second = await hutch.create_sandbox("local", workdir=tempfile.mkdtemp())
    ref = await owner.ref(expires_in=600)
    path = unix_socket_of(decode_ref(ref).url)  # type: ignore[union-attr]
    assert path is not None
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    transport = httpx.AsyncHTTPTransport(uds=path)
    async with httpx.AsyncClient(transport=transport, base_url="http://owner") as h:

        async def status(method: str, url: str, token: str | None = None) -> int:
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            return (await h.request(method, url, headers=headers, json={})).status_code

        # No ref: nothing answers (the server's token is given to no one).
        assert await status("GET", f"/v1/sandboxes/{owner.id}") == 401
        assert await status("GET", "/v1/sandboxes") == 401
        assert await status("POST", "/v1/sandboxes") == 401
        assert await status("GET", f"/v1/sandboxes/{owner.id}", ref) == 200
        for method, url in (("GET", "/v1/sandboxes"), ("POST", "/v1/sandboxes"),
                            ("GET", f"/v1/sandboxes/{second.id}"),
                            ("POST", f"/v1/sandboxes/{owner.id}/refs"),
                            ("POST", f"/v1/sandboxes/{owner.id}/snapshots")):
            assert await status(method, url, ref) in (401, 403), (method, url)
        forged = ref[:-3] + ("AAA" if not ref.endswith("AAA") else "BBB")
        assert await status("GET", f"/v1/sandboxes/{owner.id}", forged) == 401
    # The other sandbox was never served; revoking refuses the ref from then on.
    await owner.revoke_ref(ref)
    with pytest.raises(hutch.Unauthorized, match="revoked"):
        await asyncio.to_thread(hutch.attach_sync, ref)
    with pytest.raises(hutch.Unauthorized, match="revoked"):
        await hutch.attach(ref)
    await owner.close()
    assert not os.path.exists(os.path.dirname(path))  # the socket's directory went with it
    await second.close()


async def test_sync_and_async_attach_in_the_owners_process() -> None:
    """attach (async) gives an in-process session on the owner's loop;
    attach_sync gives the same sandbox with a sync face, from any thread but
    the loop's own (where it would block the loop that serves it)."""
    owner = await hutch.create_sandbox("local", workdir=tempfile.mkdtemp())
    ref = await owner.ref()
    near = await hutch.attach(ref)
    assert isinstance(near, hutch.Sandbox) and near.id == owner.id
    with pytest.raises(hutch.InvalidArgument, match=r"await hutch\.attach"):
        hutch.attach_sync(ref)

    def in_a_thread() -> str:
        with hutch.attach_sync(ref) as far:
            far.write_text("sync.txt", "s")
            return str(far.exec("cat sync.txt").stdout)

    assert await asyncio.to_thread(in_a_thread) == "s"
    assert await near.read_text("sync.txt") == "s"
    await owner.close()


def test_a_sync_owner_hands_out_refs_to_sync_and_async_workers() -> None:
    with hutch.create_sandbox_sync("local", workdir=tempfile.mkdtemp()) as owner:
        owner.write_text("a.txt", "a")
        ref = owner.ref()
        assert isinstance(ref, str)
        with hutch.attach_sync(ref) as worker:
            assert worker.read_text("a.txt") == "a"

        async def from_another_loop() -> str:
            far = await hutch.attach(ref)  # the owner's loop is another thread's
            try:
                return str(await far.read_text("a.txt"))
            finally:
                await far.close()

        assert asyncio.run(from_another_loop()) == "a"
        result: list[str] = []

        def in_a_thread() -> None:
            with hutch.attach_sync(ref) as worker:
                result.append(worker.exec("echo t").stdout)

        thread = threading.Thread(target=in_a_thread)
        thread.start()
        thread.join(60)
        assert result == ["t\n"]
        assert owner.exec("echo owner").stdout == "owner\n"


async def test_a_busy_worker_in_another_process_keeps_the_sandbox_from_idle_suspend() -> None:
    engine = hutch.LifecycleEngine()
    owner = await hutch.create_sandbox("virtual", engine=engine, idle_suspend_after=1.0,
                                       read_before_write=False)
    ref = await owner.ref()
    busy = (
        "import sys, time, hutch\n"
        "sb = hutch.attach_sync(sys.argv[1])\n"
        "for i in range(16):\n"  # 4 s of work: four idle windows, from the worker alone
        "    sb.write_text('tick', str(i)); print(i, flush=True); time.sleep(0.25)\n"
        "sb.close()\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", busy, ref, env=bare_env(),
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        # Only while the worker works (not while its interpreter exits), and
        # without a call of the owner's (its own activity would keep it awake).
        # A write resumes a suspended sandbox, so its state after each write
        # says little: the time it spent suspended must not grow.
        slept = None
        for i in range(16):
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line == f"{i}\n".encode(), (line, await proc.stderr.read())
            assert owner.state is hutch.SandboxState.RUNNING
            suspended = owner.status().meter["suspended_s"]  # reading it is not activity
            slept = suspended if slept is None else slept
            assert suspended == slept, f"suspended under a busy worker ({i})"
        assert await asyncio.wait_for(proc.wait(), 120) == 0, await proc.stderr.read()
        deadline = asyncio.get_running_loop().time() + 15
        while owner.state is not hutch.SandboxState.SUSPENDED:  # once it stops, it sleeps
            assert asyncio.get_running_loop().time() < deadline, "never suspended once idle"
            await asyncio.sleep(0.1)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await owner.close()
        await engine.close()


#: An owner in a process of its own: makes a local sandbox in argv[1],
#: prints a ref to it, and serves it until it is killed.
OWNER = r"""
import asyncio, sys, hutch

async def main():
    sb = await hutch.create_sandbox("local", workdir=sys.argv[1])
    print(await sb.ref(), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def _owner_process(workdir: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, workdir, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=bare_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    if not line:
        raise AssertionError((await proc.stderr.read()).decode()[-3000:])
    return proc, line.decode().strip()


def _directory_of(ref: str) -> str:
    decoded = decode_ref(ref)
    path = None if decoded is None else unix_socket_of(decoded.url)
    assert path is not None, ref
    return os.path.dirname(path)


async def test_a_sigkilled_owners_socket_directory_goes_at_the_next_owners_start(
    tmp_path: Any,
) -> None:
    """An owner killed with SIGKILL runs no cleanup: its socket's directory
    stays. Attaching to its refs says the owner is gone (typed, at once), and
    the next owner to start on this host removes that directory, and only
    that: a live owner's stays and goes on serving."""
    import shutil
    import signal
    import time

    dead_dir = tmp_path / "dead"
    live_dir = tmp_path / "live"
    dead_dir.mkdir()
    live_dir.mkdir()
    dead, dead_ref = await _owner_process(str(dead_dir))
    live, live_ref = await _owner_process(str(live_dir))
    leftovers = [_directory_of(dead_ref), _directory_of(live_ref)]
    # Directories whose names say a process made them that is not the one
    # now holding that pid (its start time differs: the pid was reused), and
    # one of this live process's that is not serving yet (being made).
    from hutch._liveness import process_start_time

    mine = process_start_time(os.getpid())
    assert mine is not None
    reused = tempfile.mkdtemp(prefix=f"hutch-owner-{os.getpid()}-{mine + 1}-")
    making = tempfile.mkdtemp(prefix=f"hutch-owner-{os.getpid()}-{mine}-")
    leftovers += [reused, making]
    refused = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    refused.bind(os.path.join(reused, "sock"))  # bound, never listening: as a dead owner's
    refused.close()
    owner: hutch.Sandbox | None = None
    try:
        dead.send_signal(signal.SIGKILL)
        await asyncio.wait_for(dead.wait(), 60)
        assert os.path.isdir(leftovers[0])  # no cleanup ran
        # Its refs say what happened, at once, typed: no hang, no raw OSError.
        began = time.monotonic()
        with pytest.raises(hutch.SandboxUnavailable, match="owner's process is gone"):
            await asyncio.to_thread(hutch.attach_sync, dead_ref)
        with pytest.raises(hutch.SandboxUnavailable, match="owner's process is gone"):
            await hutch.attach(dead_ref)
        assert time.monotonic() - began < 30
        # The next owner's start removes the dead one's directory, and the reused pid's.
        owner = await hutch.create_sandbox("local", workdir=str(tmp_path))
        await owner.ref()
        assert not os.path.exists(leftovers[0])
        assert not os.path.exists(reused)
        # The live owner's stays, and serves; the one being made stays too.
        assert os.path.isdir(leftovers[1]) and os.path.isdir(making)
        with await asyncio.to_thread(hutch.attach_sync, live_ref) as worker:
            assert (await asyncio.to_thread(worker.exec, "echo alive")).stdout == "alive\n"
        # Gone, its refs still answer typed (the socket itself is gone now).
        with pytest.raises(hutch.SandboxUnavailable, match="owner's process is gone"):
            await asyncio.to_thread(hutch.attach_sync, dead_ref)
    finally:
        for proc in (dead, live):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        if owner is not None:
            await owner.close()
        for directory in leftovers:
            shutil.rmtree(directory, ignore_errors=True)
