"""How the SDKs' requests reach the daemon: a small request in the write of
its head (TypeScript) or in its head's write and one more (Python: httpx's
own transport writes the body after the head); a large body streamed, a
bounded piece at a time, never held whole. The real clients against the
real daemon, watched under strace (their write syscalls, not timing).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator

import pytest

from tests.daemon_fixture import DaemonProcess

#: What the client reads from a file at a time for an upload (client._transports).
SEND_PIECE = 1024 * 1024
#: A body at most this long counts as small: written with its head, not streamed.
SMALL_BODY = 64 * 1024
#: A chunk's framing in a chunked body: its length in hex, and two line ends.
CHUNK_FRAMING = 16

METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"PATCH ")


# -- the real client and daemon, under strace -------------------------------------------

CLIENT_SCRIPT = textwrap.dedent("""
    import asyncio, io, sys, tempfile
    import hutch

    url, token, face, workdir = sys.argv[1:5]
    UPLOAD = 5 * 1024 * 1024 + 123

    def sync_calls():
        with hutch.Client(url, token=token) as client:
            sandbox = client.create_sandbox("local", workdir=workdir)
            assert sandbox.exec(["echo", "hi"]).stdout == "hi\\n"
            sandbox.write_bytes("small", b"s" * 3000)
            sandbox.write_from("large", io.BytesIO(b"L" * UPLOAD))
            assert len(sandbox.read_bytes("large")) == UPLOAD
            sandbox.close()

    async def async_calls():
        async with hutch.AsyncClient(url, token=token) as client:
            sandbox = await client.create_sandbox("local", workdir=workdir)
            assert (await sandbox.exec(["echo", "hi"])).stdout == "hi\\n"
            await sandbox.write_bytes("small", b"s" * 3000)
            await sandbox.write_from("large", io.BytesIO(b"L" * UPLOAD))
            assert len(await sandbox.read_bytes("large")) == UPLOAD
            await sandbox.close()

    sync_calls() if face == "sync" else asyncio.run(async_calls())
""")

TS_CLIENT_SCRIPT = """
import { pathToFileURL } from "node:url";
const [sdkPath, workdir] = process.argv.slice(1);
const { Client } = await import(pathToFileURL(sdkPath).href);
const UPLOAD = 5 * 1024 * 1024 + 123;
const sandbox = await new Client().createSandbox("local", { workdir });
if ((await sandbox.exec(["echo", "hi"])).stdout !== "hi\\n") throw new Error("exec");
await sandbox.writeBytes("small", new Uint8Array(3000).fill(115));
async function* pieces() {
  for (let sent = 0; sent < UPLOAD; sent += 1024 * 1024) {
    yield new Uint8Array(Math.min(1024 * 1024, UPLOAD - sent)).fill(76);
  }
}
await sandbox.writeFrom("large", pieces());
if ((await sandbox.readBytes("large")).length !== UPLOAD) throw new Error("read back");
await sandbox.close();
"""

#: A write syscall to a loopback TCP port as ``strace -xx -yy`` shows it.
_WRITE = re.compile(
    r'^(?P<call>write|sendto|sendmsg|writev)\((?P<fd>\d+)'
    r'<TCP:\[[^\]]*->127\.0\.0\.1:(?P<port>\d+)\]>, '
    r'(?P<args>.*)\) += (?P<sent>-?\d+)'
)
#: A buffer's bytes as ``-xx`` prints them, and the length strace gives after it.
_BUFFER = re.compile(r'"(?P<data>(?:\\x[0-9a-f]{2})*)"(?:\.\.\.)?(?:, iov_len=|, )(?P<size>\d+)')


def socket_writes(trace: list[str], port: int) -> list[tuple[bytes, int]]:
    """Each write syscall to the daemon's port (write, send, writev) in a
    trace's lines (each thread's in order): its first bytes, and how many
    bytes it asked to send."""
    writes = []
    for line in trace:
        match = _WRITE.match(line)
        if match is None or int(match["port"]) != port:
            continue
        assert match["call"] != "sendmsg", line  # never seen: its iovecs are deeper
        buffers = _BUFFER.findall(match["args"])
        assert buffers, line
        data = b"".join(bytes.fromhex(d.replace("\\x", "")) for d, _ in buffers)
        writes.append((data, sum(int(size) for _, size in buffers)))
    return writes


def requests_of(writes: list[tuple[bytes, int]]) -> list[tuple[bytes, list[int]]]:
    """The requests written: each one's head and body as written, and the
    sizes of the writes that carried it."""
    requests: list[tuple[bytes, list[int]]] = []
    for data, size in writes:
        if data.startswith(METHODS):
            requests.append((data, [size]))
        else:
            assert requests, f"a write before any request: {data[:80]!r}"
            requests[-1][1].append(size)
    return requests


def content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return None


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    d.close()


def traced(daemon: DaemonProcess, command: list[str], strace_args: list[str]) -> list[str]:
    """Run ``command`` (a client, given a working directory as its last
    argument) under strace with ``strace_args``: the trace's lines, each
    thread's in order."""
    scratch = tempfile.mkdtemp(prefix="hutch-writes-")
    try:
        prefix = os.path.join(scratch, "trace")
        workdir = os.path.join(scratch, "work")
        os.mkdir(workdir)
        run = subprocess.run(
            ["strace", "-f", "-ff", "-yy", "-o", prefix, *strace_args, "-e", "signal=none",
             *command, workdir],
            capture_output=True, text=True, timeout=300,
            env=dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token),
        )
        assert run.returncode == 0, run.stderr[-3000:]
        lines = []
        for path in sorted(glob.glob(prefix + ".*")):
            with open(path, encoding="ascii") as fh:
                lines += fh.readlines()
        return lines
    finally:
        shutil.rmtree(scratch)


def traced_requests(daemon: DaemonProcess, command: list[str]) -> list[tuple[bytes, list[int]]]:
    """The requests ``command`` (see :func:`traced`) wrote to the daemon."""
    trace = traced(daemon, command, ["-xx", "-s", "8192",
                                     "-e", "trace=write,sendto,sendmsg,writev"])
    return requests_of(socket_writes(trace, daemon.port))


def assert_written_whole(requests: list[tuple[bytes, list[int]]], *, head_apart: bool) -> None:
    """Every request with a small body went out in the write of its head (or,
    ``head_apart``, in that write and one more: its body); the one upload
    (chunked, 5 MB) in pieces of about a MB, never held whole."""
    assert len(requests) >= 6, requests
    uploads = 0
    for data, sizes in requests:
        head, _, body = data.partition(b"\r\n\r\n")
        length = content_length(head)
        line = head.split(b"\r\n")[0].decode()
        if length is not None and length <= SMALL_BODY:
            whole = [len(head) + 4 + length]
            apart = [len(head) + 4, length] if length else [len(head) + 4]
            assert sizes == whole or (head_apart and sizes == apart), (line, sizes)
            if sizes == whole:
                assert len(body) == length, line
        elif b"transfer-encoding: chunked" in head.lower():
            uploads += 1
            assert len(sizes) >= 5, (line, sizes)
            # A piece, its chunk's framing, and (in one) the head.
            assert max(sizes) <= SEND_PIECE + CHUNK_FRAMING + len(head) + 4, (line, sizes)
        else:
            assert sizes == [len(head) + 4] and not body, (line, sizes)
    assert uploads == 1


needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


@needs_strace
@pytest.mark.parametrize("face", ["sync", "async"])
def test_sdk_requests_go_whole_and_an_upload_in_bounded_pieces(
        daemon: DaemonProcess, face: str) -> None:
    requests = traced_requests(
        daemon, [sys.executable, "-c", CLIENT_SCRIPT, daemon.url, daemon.token, face])
    assert_written_whole(requests, head_apart=True)


@needs_strace
def test_typescript_sdk_request_head_and_small_body_go_in_one_write(
        daemon: DaemonProcess) -> None:
    """Node's http module sends a request's head with a body given whole (a
    writev), and a streamed body's pieces as they come: held to it here."""
    from tests.test_typescript_sdk import build_sdk

    sdk = build_sdk() / "dist" / "index.js"
    requests = traced_requests(
        daemon, ["node", "--input-type=module", "-e", TS_CLIENT_SCRIPT, str(sdk)])
    assert_written_whole(requests, head_apart=False)


# -- one connection for plain and streamed calls ------------------------------------------

CONNECTIONS_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import hutch

    url, token, face, workdir = sys.argv[1:5]

    def sync_calls():
        with hutch.Client(url, token=token) as client:
            sandbox = client.create_sandbox("local", workdir=workdir)
            for _ in range(2):
                assert sandbox.exec(["echo", "hi"]).stdout == "hi\\n"
                assert list(sandbox.exec_stream(["echo", "streamed"]))
            sandbox.close()

    async def async_calls():
        async with hutch.AsyncClient(url, token=token) as client:
            sandbox = await client.create_sandbox("local", workdir=workdir)
            for _ in range(2):
                assert (await sandbox.exec(["echo", "hi"])).stdout == "hi\\n"
                assert [event async for event in sandbox.exec_stream(["echo", "streamed"])]
            await sandbox.close()

    sync_calls() if face == "sync" else asyncio.run(async_calls())
""")

#: A connect syscall to a loopback TCP port as ``strace -yy`` shows it.
_CONNECT = re.compile(r'^connect\(\d+<TCP:[^>]*>, \{sa_family=AF_INET, sin_port=htons\((\d+)\)')


@needs_strace
@pytest.mark.parametrize("face", ["sync", "async"])
def test_sdk_plain_and_streamed_calls_share_one_connection(
        daemon: DaemonProcess, face: str) -> None:
    """A client's calls answered whole and those streamed go through one
    pool: one connection to the daemon, kept, not one for each kind."""
    trace = traced(daemon, [sys.executable, "-c", CONNECTIONS_SCRIPT, daemon.url,
                            daemon.token, face], ["-e", "trace=connect"])
    connects = [line for line in trace
                if (m := _CONNECT.match(line)) and int(m[1]) == daemon.port]
    assert len(connects) == 1, connects
